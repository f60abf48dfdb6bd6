# ruff: noqa: N803  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Block cross-entropy that never holds `[B, T, V]` logits for the whole batch at once."""

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hpctoolkit.models.dflash.layout import IGNORE_INDEX


def _chunk_ce_sum(hidden_NH: torch.Tensor, weight_VH: torch.Tensor, labels_N: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden_NH, weight_VH).float()
    return F.cross_entropy(logits, labels_N, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(
    hidden_NH: torch.Tensor,
    weight_VH: torch.Tensor,
    labels_N: torch.Tensor,
    *,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """Mean CE of `hidden @ weight.T` against `labels` over non-ignored rows.

    Each chunk's logits are recomputed in backward (activation checkpointing), so peak memory is
    one `[chunk_size, V]` fp32 block instead of `[N, V]`.
    """
    total = hidden_NH.new_zeros((), dtype=torch.float32)
    for start in range(0, hidden_NH.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        if torch.is_grad_enabled():
            total = total + checkpoint(
                _chunk_ce_sum, hidden_NH[sl], weight_VH, labels_N[sl], use_reentrant=False
            )
        else:
            total = total + _chunk_ce_sum(hidden_NH[sl], weight_VH, labels_N[sl])
    count = (labels_N != IGNORE_INDEX).sum().clamp(min=1)
    return total / count


def block_cross_entropy(
    hidden_BTH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    chunk_size: int = 4096,
) -> torch.Tensor:
    """DFlash loss: CE of every non-anchor slot against `BlockLayout.labels`."""
    return chunked_cross_entropy(
        hidden_BTH.flatten(0, 1), lm_head_weight_VH, labels_BT.flatten(), chunk_size=chunk_size
    )
