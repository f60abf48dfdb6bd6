# ruff: noqa: N803, N806  -- shape names (B, Q, K), per STYLE.md
"""A FlexAttention `BlockMask` built from a `mask_mod` by plain tensor code, a band of query
blocks at a time, with no `torch.compile`.

`create_block_mask` either evaluates `mask_mod` over every (q, kv) pair at once (eager: a `[B, Q,
K]` mask and its index intermediates) or compiles that evaluation. The compiled path did not finish
compiling at the K3 draft's 8192-token shape on torch 2.11 CUDA (`benchmarks/train_k3_gpu.py`,
round 3). Here the mask is evaluated over `band` rows of queries at a time, reduced to per-block
"any" and "all", and handed to `BlockMask.from_kv_blocks`: partial blocks (some pairs visible)
run `mask_mod` inside the kernel, full blocks (every pair visible) skip it. A block at the edge of
`q_len` or `kv_len` is never full, so the kernel's `mask_mod` sees it: a block counted partial
that is in fact full costs time, never correctness.
"""

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask

BLOCK = 128  # FlexAttention's default block size, for queries and keys
BAND_PAIRS = 1 << 28  # (q, kv) pairs evaluated at once: 256 Mi booleans, and their intermediates


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _band_blocks(mask_mod: Callable, batch: int, q0: int, q1: int, kv_len: int, device) -> tuple:
    """Per (b, query block, kv block) of rows q0..q1: whether any and whether all pairs are visible."""
    b = torch.arange(batch, device=device).view(-1, 1, 1)
    q = torch.arange(q0, q1, device=device).view(1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, -1)
    h = torch.zeros((), dtype=torch.long, device=device)
    seen = mask_mod(b, h, q, kv).expand(batch, q1 - q0, kv_len)
    nq, nk = _blocks(q1 - q0), _blocks(kv_len)
    padded = torch.zeros(batch, nq * BLOCK, nk * BLOCK, dtype=torch.bool, device=device)
    padded[:, : q1 - q0, :kv_len] = seen
    tiles = padded.view(batch, nq, BLOCK, nk, BLOCK)
    return tiles.any(dim=4).any(dim=2), tiles.all(dim=4).all(dim=2)


def _indices(has_BQK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(num_blocks [B, 1, Q], indices [B, 1, Q, K])`: the marked kv blocks of each row first, in order."""
    num = has_BQK.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~has_BQK).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num.unsqueeze(1), order.unsqueeze(1)


def build_block_mask(mask_mod: Callable, batch: int, q_len: int, kv_len: int, device: torch.device) -> object:
    """The `BlockMask` of `mask_mod` over `batch x q_len x kv_len` (heads broadcast), on `device`."""
    rows = max(BLOCK, (BAND_PAIRS // max(kv_len * batch, 1)) // BLOCK * BLOCK)
    anys, alls = [], []
    for q0 in range(0, q_len, rows):
        a, f = _band_blocks(mask_mod, batch, q0, min(q_len, q0 + rows), kv_len, device)
        anys.append(a)
        alls.append(f)
    any_BQK, all_BQK = torch.cat(anys, dim=1), torch.cat(alls, dim=1)
    # Edge blocks hold padding, so `all` is False there already: they stay partial.
    partial_num, partial_idx = _indices(any_BQK & ~all_BQK)
    full_num, full_idx = _indices(all_BQK)
    return BlockMask.from_kv_blocks(
        partial_num,
        partial_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(q_len, kv_len),
    )
