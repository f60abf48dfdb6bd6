# ruff: noqa: N803  -- shape-suffixed tensor names (counts_V), per STYLE.md
"""The pruned draft vocabulary: counting a sample's supervised tokens, choosing the most frequent.

A family whose trainer sets `prunes_vocab` (Eagle3) may have `draft_vocab_size < vocab_size`;
its draft vocabulary is chosen from token counts before the trainer is built
(`train.build.needs_vocab_counts`), by the trainers from the data or by the engines' counts.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hpctoolkit.errors import ConfigError


class _TokenSample(Protocol):
    """A `data.sample.Sample` or a `SyntheticSample` (which has no `loss_mask`)."""

    @property
    def input_ids(self) -> torch.Tensor: ...


def supervised_token_counts(sample: _TokenSample, vocab_size: int) -> torch.Tensor:
    """`[V]` float64 counts of a sample's supervised tokens (all of them without a loss mask)."""
    ids = sample.input_ids.long()
    mask = getattr(sample, "loss_mask", None)
    if mask is not None:
        ids = ids[mask.bool()]
    return torch.bincount(ids, minlength=vocab_size)[:vocab_size].to(torch.float64)


def draft_vocab_from_counts(counts_V: torch.Tensor, draft_vocab_size: int) -> torch.Tensor:
    """The `draft_vocab_size` most frequent target ids, ascending (ties: lower id first)."""
    if draft_vocab_size > counts_V.numel():
        raise ConfigError(f"draft_vocab_size={draft_vocab_size} exceeds the vocabulary {counts_V.numel()}")
    order = torch.argsort(
        -counts_V.to(torch.float64) * (counts_V.numel() + 1) + torch.arange(counts_V.numel())
    )
    return order[:draft_vocab_size].sort().values
