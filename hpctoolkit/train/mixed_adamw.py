"""AdamW for one rank's mixed precision: reads the bf16 gradients, writes the bf16 weights.

Under `fsdp.LocalMixedPrecision` (one rank, bf16 compute, fp32 master weights), the plain path
around a fused AdamW moves every trainable parameter's bytes three times a step: the bf16
gradient cast to fp32 (`.grad`), the fused AdamW over fp32 weights, gradients and moments, then
the fp32 weights cast into their bf16 twins before the next forward. `MixedAdamW` does it in one
pass per tensor: one Triton kernel reads the bf16 gradient, the fp32 weight and moments, and
writes the weight, the moments and the bf16 twin (28 bytes a parameter instead of 40). At K3
shapes on one H200 that is the fixed part of a step: 2.83 B trainable parameters
(`benchmarks/train_k3_gpu.py`).

The update is AdamW's as `torch.optim.AdamW(fused=True)` computes it (fp32 arithmetic, the clip
factor as `grad_scale` dividing each gradient, decoupled weight decay, bias corrections from the
per-parameter `step` tensor), to within fp32 rounding: tested against it on the GPU
(`tests/gpu/test_train_gpu.py`), and the reference below against `torch.optim.AdamW` on the CPU. The
optimizer is a `torch.optim.AdamW` (fused, its state and `state_dict` exactly AdamW's), so
checkpoints move between this path and the plain one. A step where some parameter holds an fp32
`.grad` (Distributed Checkpoint's state initialisation, or no bf16 gradients kept) is AdamW's own.
"""

from __future__ import annotations

from typing import Any

import torch

try:  # the GPU machine has triton; a CPU-only install does not need it
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None

BLOCK = 2048


def available(device: torch.device) -> bool:
    """Whether the fused kernel can run for parameters on `device`."""
    return device.type == "cuda" and triton is not None


if triton is not None:

    @triton.jit
    def _adamw_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, twin_ptr, step_ptr, scale_ptr, n,
        lr, beta1, beta2, eps, weight_decay,
        HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr,  # noqa: N803 (triton constexprs)
    ):  # fmt: skip
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        step = tl.load(step_ptr)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        if HAS_SCALE:
            g = g / tl.load(scale_ptr)
        p = tl.load(p_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        p = p - lr * weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        bias1 = 1 - libdevice.pow(beta1, step)
        bias2_sqrt = tl.sqrt(1 - libdevice.pow(beta2, step))
        p = p - (lr / bias1) * m / (tl.sqrt(v) / bias2_sqrt + eps)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(twin_ptr + offs, p.to(twin_ptr.dtype.element_ty), mask=mask)


def adamw_step_(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    twin: torch.Tensor,
    step: torch.Tensor,
    grad_scale: torch.Tensor | None,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update of fp32 `p` (and its moments) from `grad` (any float dtype), in place;
    `twin` receives the new `p` in its own dtype. `step` is the count after this update."""
    grad = grad.contiguous()  # the kernel walks all five tensors as flat arrays
    if available(p.device):
        n = p.numel()
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            p, grad, exp_avg, exp_avg_sq, twin, step, grad_scale if grad_scale is not None else step, n,
            lr, beta1, beta2, eps, weight_decay,
            HAS_SCALE=grad_scale is not None, BLOCK=BLOCK,
        )  # fmt: skip
        return
    reference_step_(p, grad, exp_avg, exp_avg_sq, twin, step, grad_scale, lr=lr, beta1=beta1,
                    beta2=beta2, eps=eps, weight_decay=weight_decay)  # fmt: skip


def reference_step_(
    p, grad, exp_avg, exp_avg_sq, twin, step, grad_scale, *, lr, beta1, beta2, eps, weight_decay
):
    """The kernel's arithmetic in torch operations (CPU, and the tests' reference)."""
    with torch.no_grad():
        g = grad.to(torch.float32)
        if grad_scale is not None:
            g = g / grad_scale
        p.sub_(lr * weight_decay * p)
        exp_avg.mul_(beta1).add_((1 - beta1) * g)
        exp_avg_sq.mul_(beta2).add_((1 - beta2) * g * g)
        s = step.to(torch.float32)
        bias1 = 1 - torch.pow(torch.tensor(beta1, dtype=torch.float32), s)
        bias2_sqrt = torch.sqrt(1 - torch.pow(torch.tensor(beta2, dtype=torch.float32), s))
        p.sub_((lr / bias1) * exp_avg / (exp_avg_sq.sqrt() / bias2_sqrt + eps))
        twin.copy_(p)


class MixedAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW` (fused) whose step reads the bf16 gradients `LocalMixedPrecision` kept
    and writes its bf16 twins (module doc). `grad_scale` (a tensor, or None) divides every
    gradient of the next step, as the fused AdamW's; `optim.clip_grad_norm` sets it."""

    def __init__(self, params, mixed: Any, **kwargs: Any) -> None:
        super().__init__(params, fused=True, **kwargs)
        self.mixed = mixed
        self.grad_scale: torch.Tensor | None = None
        mixed.keep_low_precision_grads = True

    @torch.no_grad()
    def step(self, closure=None):
        held = self.mixed.low_precision_grads()
        if (
            closure is not None
            or not held
            or any(p.grad is not None for g in self.param_groups for p in g["params"])
        ):
            self.mixed.drop_low_precision_grads()
            return super().step(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            items = [(p, held[p]) for p in group["params"] if p in held]
            for p, _ in items:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if not items:
                continue
            torch._foreach_add_([self.state[p]["step"] for p, _ in items], 1)
            for p, (grad, twin) in items:
                state = self.state[p]
                adamw_step_(
                    p, grad, state["exp_avg"], state["exp_avg_sq"], twin, state["step"], self.grad_scale,
                    lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"],
                )  # fmt: skip
        self.mixed.drop_low_precision_grads(twins_current=True)
        return None
