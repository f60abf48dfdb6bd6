# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""The loss pieces every family shares: what a loss returns (`LossParts`), chunked row-wise
logits, per-position sums, and simulated acceptance from matches. Each family's loss is in its
folder (`models/<family>/loss.py`); the training loop (`train/`) reduces what they return.

Normalisation contract (all families): a loss returns a weighted *sum* over its supervised
positions (`numerator`, carries the graph) and the sum of those weights (`denominator`). The
training loop all-reduces only the denominator and backpropagates
`numerator / global_denominator * world_size`; FSDP then averages gradients over ranks, so the
effective gradient is that of `sum_ranks(numerator) / sum_ranks(denominator)`, independent of how
the global batch is split over ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

# Rows of logits materialised at once; each chunk is recomputed in backward, so the peak is one
# `[chunk, V]` fp32 block rather than `[rows, V]`.
LOGIT_CHUNK_ROWS = 2048


@dataclass
class LossParts:
    """One rank's contribution to a step.

    `numerator` (graph) and `denominator` (no graph) follow the contract above.
    Per-position statistics are sums over this rank, shape `[P]` with `P` draft positions (DFlash
    slots 1..K-1, Eagle3 test-time steps); the loop all-reduces and divides them:

    - `pos_loss_sum` / `pos_weight`: unweighted mean loss per position;
    - `pos_correct` / `pos_count`: draft greedy token == target greedy token;
    - `reach` / `chains`: simulated acceptance. A chain is one full draft (one DFlash block, one
      Eagle3 start position); `reach[k]` counts chains whose first `k + 1` drafts all match the
      target, so `reach.sum() / chains` is the mean number of accepted drafts, bonus excluded.
    """

    numerator: torch.Tensor
    denominator: torch.Tensor
    pos_loss_sum: torch.Tensor
    pos_weight: torch.Tensor
    pos_correct: torch.Tensor
    pos_count: torch.Tensor
    reach: torch.Tensor
    chains: torch.Tensor
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # `[num_chains, P]` greedy matches per chain, in chain order (DFlash: anchor order; Eagle3:
    # start position), before masking; evaluation replays vLLM's verification schedule on them.
    chain_matches: torch.Tensor | None = None

    def stats_vector(self) -> torch.Tensor:
        """Every no-graph statistic in one fp64 vector, for a single all-reduce."""
        parts = [
            self.denominator.reshape(1),
            self.numerator.detach().reshape(1),
            self.pos_loss_sum,
            self.pos_weight,
            self.pos_correct,
            self.pos_count,
            self.reach,
            self.chains.reshape(1),
            *(v.detach().reshape(1) for v in self.extras.values()),
        ]
        return torch.cat([p.to(torch.float64).flatten() for p in parts])


def acceptance_from_matches(
    match_NP: torch.Tensor, chain_ok_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(reach [P], chains [])` from per-chain greedy matches `[N, P]`.

    Drafts are accepted left to right until the first mismatch (greedy verification), so the
    accepted prefix of a chain is the cumulative product of its matches. Only chains with every
    position defined (`chain_ok_N`) count.
    """
    ok = chain_ok_N.bool()
    prefix_NP = torch.cumprod(match_NP.to(torch.float64), dim=1) * ok.unsqueeze(1)
    return prefix_NP.sum(0), ok.sum().to(torch.float64)


def chunked_rows(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    *rows: torch.Tensor,
    consts: tuple[torch.Tensor, ...] = (),
    chunk: int = LOGIT_CHUNK_ROWS,
) -> tuple[torch.Tensor, ...]:
    """Apply `fn(*row_chunks, *consts)` over row chunks (checkpointed when grad is on); concat outputs."""
    outs: list[tuple[torch.Tensor, ...]] = []
    n = rows[0].shape[0]
    for start in range(0, max(n, 1), chunk):
        sl = [r[start : start + chunk] for r in rows]
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*sl, *consts)):
            outs.append(checkpoint(fn, *sl, *consts, use_reentrant=False))
        else:
            outs.append(fn(*sl, *consts))
    return tuple(torch.cat(list(col)) for col in zip(*outs, strict=True))


def per_position(values_NP: torch.Tensor, mask_NP: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(sum over rows of values where mask, count where mask)`, both `[P]` fp64."""
    m = mask_NP.to(torch.float64)
    return (values_NP.detach().to(torch.float64) * m).sum(0), m.sum(0)
