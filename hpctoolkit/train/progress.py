"""Rank 0's progress while it trains: at a steady interval (`training.progress_every_s`, and at
the last step) one `[hpctoolkit.trainer] step k/n, loss, tau, samples/s, tokens/s, ETA` line, which
the launcher copies to its console, and the record `progress/trainer.json` of a run directory,
which `python -m hpctoolkit.status` reads (`rundir.progress`).

On a terminal (`python -m hpctoolkit.train` by hand) a tqdm bar also shows every step, and the
lines are written around it. Elsewhere (a role's log, a Slurm log) there is no bar: its carriage
returns would run into the lines and bury them.

The rates are the average since the first step of this run finished, so neither the start (the
first samples' wait, the first step's compilation) nor one short interval skews them or the ETA;
tau is the acceptance length (incl. bonus) over the loop's recent window of steps.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from hpctoolkit.console import speaker
from hpctoolkit.rundir.progress import Ticker, trainer_line, write_progress

say = speaker("trainer")


class TrainProgress:
    """Built on rank 0 only; `step(...)` after each finished step, `close()` at the end."""

    def __init__(
        self,
        *,
        family: str,
        total: int,
        start_step: int,
        samples_per_step: int,
        every_s: float,
        record: str = "",
        bar: bool = True,
    ):
        self.total, self.samples_per_step, self.record = total, samples_per_step, record
        self.ticker = Ticker(every_s)
        self._first: tuple[float, int, float] | None = None  # (time, step, tokens) of the first step
        self.bar: Any = None
        if bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start_step, desc=f"train {family}", dynamic_ncols=True)

    def step(
        self, step: int, stats: Any, scalars: dict[str, float], tokens_total: float, window: Any
    ) -> None:
        """After step `step` (`stats`: its `StepStats`; `window`: the loop's recent steps)."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                loss=f"{stats.loss:.3f}",
                acc0=f"{stats.pos_accuracy()[0]:.2f}",
                tau=f"{stats.acceptance_length_incl_bonus():.2f}",
                gn=f"{scalars['grad_norm']:.2f}",
                tok_s=f"{scalars['tokens_per_s']:.0f}",
            )
        now = time.monotonic()
        if self._first is None:
            self._first = (now, step, tokens_total)
            self.ticker.due()  # the first report one interval after the first step, or at the last
        if not self.ticker.due(last=step >= self.total):
            return
        t, s, tok = self._first
        dt = max(now - t, 1e-9)
        steps_per_s = (step - s) / dt
        recent = window.total()
        record = {
            "role": "trainer",
            "step": step,
            "total": self.total,
            "loss": stats.loss,
            "tau": recent.acceptance_length_incl_bonus() if recent is not None else None,
            "samples_per_s": steps_per_s * self.samples_per_step if step > s else None,
            "tokens_per_s": (tokens_total - tok) / dt if step > s else None,
            "eta_s": (self.total - step) / steps_per_s if steps_per_s > 0 else None,
        }
        self._say(trainer_line(record))
        if self.record:
            write_progress(self.record, record)

    def _say(self, line: str) -> None:
        if self.bar is None:
            say(line)
            return
        with self.bar.external_write_mode():  # the bar steps aside for the line
            say(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
