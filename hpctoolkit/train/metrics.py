# ruff: noqa: N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Step metrics: per-position accuracy and loss, simulated acceptance, throughput.

Acceptance-length conventions (both are always reported, under explicit names):

- `acceptance_length_incl_bonus` = 1 + mean accepted drafts per verification. This is what
  EAGLE papers and vLLM's `1 + num_accepted_tokens / num_drafts` report: every verification
  emits the target's own (bonus) token on top of the accepted drafts.
- `simulated_acc_len_excl_bonus` = mean accepted drafts, TorchSpec's `simulated_acc_len`.

`acceptance_rate_per_pos[k]` is the fraction of draft chains whose first `k + 1` drafts were all
accepted (vLLM's `num_accepted_tokens_per_pos[k] / num_drafts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hpctoolkit.models.common.losses import LossParts


def _div(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return [float(x) / float(y) if float(y) > 0 else 0.0 for x, y in zip(a, b, strict=True)]


@dataclass
class StepStats:
    """Globally summed statistics of one or more steps (the all-reduced `LossParts` vectors)."""

    num_positions: int
    extra_names: tuple[str, ...]
    vec: torch.Tensor
    steps: int = 1

    @classmethod
    def layout(cls, parts: LossParts) -> tuple[int, tuple[str, ...]]:
        return parts.pos_count.numel(), tuple(parts.extras)

    def _sl(self, i: int) -> torch.Tensor:
        P = self.num_positions
        start = 2 + i * P
        return self.vec[start : start + P]

    @property
    def denominator(self) -> float:
        return float(self.vec[0])

    @property
    def loss(self) -> float:
        return float(self.vec[1]) / self.denominator if self.denominator > 0 else 0.0

    @property
    def chains(self) -> float:
        return float(self.vec[2 + 5 * self.num_positions])

    def extras(self) -> dict[str, float]:
        base = 3 + 5 * self.num_positions
        return {
            n: float(self.vec[base + i]) / self.denominator if self.denominator > 0 else 0.0
            for i, n in enumerate(self.extra_names)
        }

    def pos_loss(self) -> list[float]:
        return _div(self._sl(0), self._sl(1))

    def pos_accuracy(self) -> list[float]:
        return _div(self._sl(2), self._sl(3))

    def acceptance_rate_per_pos(self) -> list[float]:
        c = self.chains
        return [float(x) / c if c > 0 else 0.0 for x in self._sl(4)]

    def simulated_acc_len_excl_bonus(self, max_drafts: int | None = None) -> float:
        rates = self.acceptance_rate_per_pos()
        return float(sum(rates[: max_drafts or len(rates)]))

    def acceptance_length_incl_bonus(self, max_drafts: int | None = None) -> float:
        return 1.0 + self.simulated_acc_len_excl_bonus(max_drafts)

    def __add__(self, other: StepStats) -> StepStats:
        return StepStats(self.num_positions, self.extra_names, self.vec + other.vec, self.steps + other.steps)

    def summary(self) -> dict:
        return {
            "loss": self.loss,
            "per_position_loss": self.pos_loss(),
            "per_position_accuracy": self.pos_accuracy(),
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos(),
            "acceptance_length_incl_bonus": self.acceptance_length_incl_bonus(),
            "simulated_acc_len_excl_bonus": self.simulated_acc_len_excl_bonus(),
            "chains": self.chains,
            **{f"loss_{k}": v for k, v in self.extras().items()},
        }


@dataclass
class Window:
    """Running sum of the last `size` steps' stats (what the final summary reports)."""

    size: int
    items: list[StepStats] = field(default_factory=list)

    def add(self, s: StepStats) -> None:
        self.items.append(s)
        del self.items[: -self.size]

    def total(self) -> StepStats | None:
        if not self.items:
            return None
        out = self.items[0]
        for s in self.items[1:]:
            out = out + s
        return out


TRAINER_CONVENTION = (
    "trainer figures: the draft on its own training batches (the last train_window_steps steps), "
    "a chain from every supervised start position (not vLLM's schedule), incl. the +1 bonus token "
    "(EAGLE / vLLM convention); acceptance_length is at the draft's own depth (acceptance_depth "
    "drafts: Eagle3 ttt_length, DFlash block_size - 1), acceptance_length_by_k[k] counts only the "
    "first k drafts of each chain, acceptance_length_at_served_k is that at evaluate's k (compare it "
    "with served_acceptance_length)"
)


def trainer_figures(total: StepStats | None) -> dict:
    """The trainer's acceptance figures for a summary, each at a named depth (`TRAINER_CONVENTION`);
    the one at the served k is picked from `acceptance_length_by_k` where k is known (`roles`)."""
    by_k = (
        {}
        if total is None
        else {str(k): total.acceptance_length_incl_bonus(k) for k in range(1, total.num_positions + 1)}
    )
    return {
        "acceptance_length": total.acceptance_length_incl_bonus() if total else None,
        "acceptance_depth": total.num_positions if total else None,
        "acceptance_length_by_k": by_k,
        "acceptance_convention": TRAINER_CONVENTION,
    }


class TensorBoardLog:
    """Scalars per step; only the main rank writes."""

    def __init__(self, log_dir, enabled: bool) -> None:
        self.writer = None
        if enabled:
            # Here: tensorboard (and its protobuf) loads only on the rank that writes.
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, step: int, stats: StepStats, scalars: dict[str, float]) -> None:
        if self.writer is None:
            return
        w = self.writer
        for k, v in scalars.items():
            w.add_scalar(f"train/{k}", v, step)
        w.add_scalar("train/loss", stats.loss, step)
        for k, v in stats.extras().items():
            w.add_scalar(f"train/loss_{k}", v, step)
        w.add_scalar("accept/acceptance_length_incl_bonus", stats.acceptance_length_incl_bonus(), step)
        w.add_scalar("accept/simulated_acc_len_excl_bonus", stats.simulated_acc_len_excl_bonus(), step)
        for pos, (acc, loss, rate) in enumerate(
            zip(stats.pos_accuracy(), stats.pos_loss(), stats.acceptance_rate_per_pos(), strict=True)
        ):
            w.add_scalar(f"position/accuracy_{pos}", acc, step)
            w.add_scalar(f"position/loss_{pos}", loss, step)
            w.add_scalar(f"position/acceptance_{pos}", rate, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
