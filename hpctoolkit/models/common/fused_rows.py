# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_NH), per STYLE.md
"""A block-draft loss fused with its vocabulary GEMMs, one row chunk at a time.

The DFlash-family losses score each draft slot against the target: per row, the draft logits
`h @ lm_head.T (+ markov @ w2.T)` and the target logits `target_fn(target_row)` are formed once
per chunk, a family's `rows_fn` turns them into the chunk's weighted loss, its per-row statistics
and the gradient with respect to the draft logits, and the gradient GEMMs run at once. Backward
only rescales the stored gradients: no `[rows, V]` tensor outlives its chunk and no logits are
recomputed (a checkpointed chunk would form the draft logits twice). The caller drops the rows
that can never be scored (each block's anchor) before calling.

`rows_fn(z_NV, t_NV, labels_N, weight_N, grad_dtype, labels_from_target) -> (weighted loss sum,
(per-row statistics...), d(sum)/d z_NV)`; `compiled` wraps it in `torch.compile` (one fused
elementwise kernel per chunk on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hpctoolkit.models.common.fused_ce import IGNORE_INDEX

_COMPILED: dict[Callable, Callable] = {}


def _rows_fn(fn: Callable, compiled: bool) -> Callable:
    if not compiled:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=False)
    return _COMPILED[fn]


def even_chunks(n: int, target: int) -> list[slice]:
    """Row slices of (nearly) equal size <= target: one compiled shape, not a ragged tail."""
    pieces = max(1, math.ceil(n / target))
    size = math.ceil(n / pieces) if n else 0
    return [slice(i, min(i + size, n)) for i in range(0, n, size)] if n else []


class FusedBlockRows(torch.autograd.Function):
    """`(weighted loss sum, *per-row statistics)`; gradients formed in forward.

    `m_NR` / `w2_VR` (DSpark's markov term) may be None. `stat_dtypes` gives the statistics'
    dtypes (None: the accumulation dtype), so a call with no rows still returns them."""

    @staticmethod
    def forward(
        ctx,
        h_NH,
        m_NR,
        w_VH,
        w2_VR,
        t_NH,
        labels_N,
        weight_N,
        target_fn,
        rows_fn,
        stat_dtypes,
        chunk,
        compiled,
        from_target,
    ):
        n = h_NH.shape[0]
        dev = h_NH.device
        acc = torch.promote_types(h_NH.dtype, torch.float32)  # fp32, or fp64 in the CPU tests
        markov = m_NR is not None
        need = (
            h_NH.requires_grad,
            markov and m_NR.requires_grad,
            w_VH.requires_grad,
            markov and w2_VR.requires_grad,
        )
        g_h = torch.zeros_like(h_NH) if need[0] else None
        g_m = torch.zeros_like(m_NR) if need[1] else None
        g_w = torch.zeros_like(w_VH, dtype=acc) if need[2] else None
        g_w2 = torch.zeros_like(w2_VR, dtype=acc) if need[3] else None
        total = torch.zeros((), dtype=acc, device=dev)
        stats = [torch.zeros(n, dtype=dt or acc, device=dev) for dt in stat_dtypes]
        rows = _rows_fn(rows_fn, compiled)
        for sl in even_chunks(n, chunk):
            z = h_NH[sl] @ w_VH.t()
            if markov:
                z = torch.addmm(z, m_NR[sl], w2_VR.t())
            t = target_fn(t_NH[sl])
            part, chunk_stats, grad = rows(z, t, labels_N[sl], weight_N[sl], h_NH.dtype, from_target)
            total += part
            for out, s in zip(stats, chunk_stats, strict=True):
                out[sl] = s
            del z, t
            if g_h is not None:
                g_h[sl] = grad @ w_VH
            if g_m is not None:
                g_m[sl] = grad @ w2_VR
            if g_w is not None:
                g_w += (grad.t() @ h_NH[sl]).to(acc)
            if g_w2 is not None:
                g_w2 += (grad.t() @ m_NR[sl]).to(acc)
        ctx.grads = (g_h, g_m, g_w, g_w2)
        ctx.dtypes = (h_NH.dtype, m_NR.dtype if markov else None, w_VH.dtype, w2_VR.dtype if markov else None)
        ctx.mark_non_differentiable(*stats)
        return (total, *stats)

    @staticmethod
    def backward(ctx, grad_total, *_unused):
        grads, ctx.grads = ctx.grads, None
        out = [
            None if g is None else (g * grad_total.to(g.dtype)).to(dt)
            for g, dt in zip(grads, ctx.dtypes, strict=True)
        ]
        return (*out, *([None] * 9))


def fused_block_rows(
    rows_fn: Callable,
    stat_dtypes: tuple[torch.dtype | None, ...],
    h_NH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    target_fn: Callable[[torch.Tensor], torch.Tensor],
    target_rows_NH: torch.Tensor,
    labels_N: torch.Tensor,
    weight_N: torch.Tensor,
    *,
    markov_NR: torch.Tensor | None = None,
    markov_w2_VR: torch.Tensor | None = None,
    chunk_rows: int,
    compiled: bool,
    labels_from_target: bool,
) -> tuple[torch.Tensor, ...]:
    """`FusedBlockRows` over the given (already anchor-free) rows; see the module docstring."""
    return FusedBlockRows.apply(
        h_NH,
        markov_NR,
        lm_head_VH,
        markov_w2_VR,
        target_rows_NH,
        labels_N,
        weight_N,
        target_fn,
        rows_fn,
        stat_dtypes,
        chunk_rows,
        compiled,
        labels_from_target,
    )


def drop_anchor(x_BT_: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[B, T, ...] -> [B * N * (K - 1), ...]`: every slot but each block's anchor (slot 0)."""
    B, T, K = x_BT_.shape[0], x_BT_.shape[1], block_size
    rest = x_BT_.shape[2:]
    return x_BT_.reshape(B, T // K, K, *rest)[:, :, 1:].reshape(B * (T // K) * (K - 1), *rest)


def unslot(x_n: torch.Tensor, batch: int, num_tokens: int, block_size: int) -> torch.Tensor:
    """The inverse of `drop_anchor` for per-row values: `[B, T]`, zero (False) at the anchor slots."""
    K = block_size
    full = x_n.new_zeros(batch * (num_tokens // K), K)
    full[:, 1:] = x_n.view(-1, K - 1)
    return full.view(batch, num_tokens)


def row_targets(t_NV: torch.Tensor, labels_N: torch.Tensor, labels_from_target: bool):
    """`(tgt_N, labels_N)`: the target's argmax per row, and the rows' labels with, when
    `labels_from_target`, each supervised one (not `IGNORE_INDEX`) replaced by that argmax."""
    tgt = t_NV.argmax(-1)
    if labels_from_target:
        labels_N = torch.where(labels_N != IGNORE_INDEX, tgt, labels_N)
    return tgt, labels_N
