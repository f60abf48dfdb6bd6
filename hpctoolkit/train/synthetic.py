"""Deterministic synthetic samples: a picklable `samples_source` factory for tests and benchmarks.

Sample `i` is a pure function of `(seed, i)`, so any rank, epoch or resume offset can regenerate
exactly the sample it would have read. Hidden states are random (nothing to learn); they
exercise shapes, sharding, normalisation and resume, not convergence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SyntheticSample:
    """Field-compatible with `hpctoolkit.data.sample.Sample` (no manifest: pre-norm assumed)."""

    key: str
    input_ids: torch.Tensor
    aux_hidden_states: torch.Tensor
    last_hidden_states: torch.Tensor
    manifest: Any = None


@dataclass
class SyntheticSamples:
    """`factory(rank, world_size, epoch, skip)`: `num_samples` samples, rank `r` takes `i % w == r`."""

    num_samples: int
    vocab_size: int
    hidden_size: int
    num_aux: int
    min_len: int = 16
    max_len: int = 48
    seed: int = 0
    dtype: torch.dtype = torch.float32
    scale: float = 1.0
    lengths: list[int] = field(default_factory=list)

    def sample(self, i: int) -> SyntheticSample:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        n = (
            self.lengths[i % len(self.lengths)]
            if self.lengths
            else int(torch.randint(self.min_len, self.max_len + 1, (1,), generator=g))
        )
        ids = torch.randint(0, self.vocab_size, (n,), generator=g)
        aux = torch.randn(self.num_aux, n, self.hidden_size, generator=g) * self.scale
        last = torch.randn(n, self.hidden_size, generator=g) * self.scale
        return SyntheticSample(f"syn-{i}", ids, aux.to(self.dtype), last.to(self.dtype))

    def __call__(self, rank: int, world_size: int, epoch: int, skip: int):
        # Every epoch replays the same order: tests want the sequence predictable.
        idx = list(range(rank, self.num_samples, world_size))[skip:]
        for i in idx:
            yield self.sample(i)
