"""AdamW over the trainable (sharded, fp32) parameters and a warmup + cosine schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from hpctoolkit.train.config import TrainingConfig

# The cosine ends at this fraction of the peak rate rather than 0, so the last steps still learn.
MIN_LR_RATIO = 0.1


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Multiplier on the peak lr for optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def build_optimizer(model: nn.Module, cfg: TrainingConfig):
    """AdamW (fused into one kernel per step on CUDA: 23 ms instead of foreach's 62 ms over the
    K3 draft's 2.83 B fp32 parameters on an H200) and its schedule."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    opt = torch.optim.AdamW(
        params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), fused=fused or None
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps))
    return opt, sched


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Global gradient norm (before clipping), as a tensor (no device sync); clips when `max_norm > 0`."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros(())
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm
