"""AdamW over the trainable (sharded, fp32) parameters and a warmup + cosine schedule."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hpctoolkit.errors import ConfigError
from hpctoolkit.train import mixed_adamw
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
    K3 draft's 2.83 B fp32 parameters on an H200) and its schedule. One rank in bf16 on CUDA
    (`LocalMixedPrecision`) gets `MixedAdamW`, which also takes in the gradient and weight casts,
    unless `training.optimizer: adamw`; `mixed_adamw` where it cannot run is refused."""
    params = [p for p in model.parameters() if p.requires_grad]
    fused = bool(params) and all(p.device.type == "cuda" for p in params)
    local = getattr(model, "_local_mixed_precision", None)
    kwargs: dict[str, Any] = {"lr": cfg.lr, "weight_decay": cfg.weight_decay, "betas": (0.9, 0.95)}
    mixed_ok = fused and local is not None and mixed_adamw.available(params[0].device)
    if cfg.optimizer == "mixed_adamw" and not mixed_ok:
        why = (
            "the parameters are not on CUDA" if not fused
            else "this rank does not train in bf16 without FSDP (one rank, LocalMixedPrecision)" if local is None
            else "triton is not installed"
        )  # fmt: skip
        raise ConfigError(f"training.optimizer: mixed_adamw cannot run here: {why}; use adamw or auto")
    if mixed_ok and cfg.optimizer != "adamw":
        opt: torch.optim.AdamW = mixed_adamw.MixedAdamW(params, local, **kwargs)
    else:
        opt = torch.optim.AdamW(params, fused=fused or None, **kwargs)
    if fused:
        # `clip_grad_norm` hands the fused step its clip factor; it holds for that step only.
        opt.register_step_post_hook(lambda o, args, kwargs: setattr(o, "grad_scale", None))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, cfg.warmup_steps, cfg.steps))
    return opt, sched


def _fused(optimizer) -> bool:
    return optimizer is not None and all(g.get("fused") for g in optimizer.param_groups)


def _plain(params: list[nn.Parameter]) -> bool:
    """No DTensor among them (one rank: no FSDP): a plain-tensor `grad_scale` is safe."""
    return not any(hasattr(p.grad, "full_tensor") for p in params)


def clip_grad_norm(model: nn.Module, max_norm: float, optimizer=None) -> torch.Tensor:
    """Global gradient norm (before clipping), as a tensor (no device sync); clips when `max_norm > 0`.

    With a fused `optimizer` (AdamW on CUDA) the gradients are not rescaled here: the clip factor
    goes to the optimizer's next `step()` as the divisor its fused kernel applies to every gradient
    as it reads it (`grad_scale`, the protocol of `torch.amp.GradScaler`), which saves a read and
    a write of every gradient (6 ms a step at K3 shapes on one H200). `clip_grad_norm_` multiplies
    by `c = min(1, max_norm / (norm + 1e-6))`; the kernel divides by `1 / c`, the same to within
    one rounding (exactly the same when nothing is clipped). Sharded (FSDP, several ranks)
    gradients are clipped in place as before: each rank rescales only its shard there.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if _fused(optimizer):
        optimizer.grad_scale = None
    held = optimizer.mixed.low_precision_grads() if isinstance(optimizer, mixed_adamw.MixedAdamW) else {}
    if held and not params:
        # bf16 gradients, the norm accumulated in fp32 (each is exactly its fp32 upcast)
        grads = [g for g, _ in held.values()]
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)))
        return _fold_clip_factor(optimizer, norm, max_norm)
    if not params:
        return torch.zeros(())
    if max_norm > 0 and _fused(optimizer) and _plain(params):
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        return _fold_clip_factor(optimizer, norm, max_norm)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return norm


def _fold_clip_factor(optimizer, norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Hand the fused step `1 / c`, `c = min(1, max_norm / (norm + 1e-6))` (nothing when
    `max_norm <= 0`); returns `norm`."""
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        optimizer.grad_scale = (1.0 / coef).to(torch.float32)
    return norm
