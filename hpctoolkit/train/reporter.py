"""Rank 0's progress while it trains: at a steady interval (`training.progress_every_s`, and at
the last step) one `[hpctoolkit.trainer] step k/n, loss, tau, samples/s, tokens/s, ETA` line, which
the launcher copies to its console, and the record `progress/trainer.json` of a run directory,
which `python -m hpctoolkit.status` reads (`rundir.progress`).

On a terminal (`python -m hpctoolkit.train` by hand) a tqdm bar also shows every step, and the
lines are written around it. Elsewhere (a role's log, a Slurm log) there is no bar: its carriage
returns would run into the lines and bury them.

The rates, and the ETA from them, are over the last `RATE_REPORTS` intervals (from the first step
of this run at the start), so neither the start (the first samples' wait, the first steps'
compilation) nor one short interval skews them. An average since the first step did: on the H100
(2026-12-05, `make run`) the trainer's first steps, compiling for new shapes while the first pass
came from the store, put the ETA at 4h28m at step 2 and 21m at step 40 of a run that ended 9
minutes after it started. tau is the acceptance length (incl. bonus) over the loop's recent window
of steps.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from hpctoolkit.output.console import speaker
from hpctoolkit.output.figures import figure
from hpctoolkit.rundir.progress import Ticker, trainer_progress_line, write_progress

say = speaker("trainer")
# The rates and the ETA: over this many report intervals back.
RATE_REPORTS = 3


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
        clock: Callable[[], float] = time.monotonic,
    ):
        self.total, self.samples_per_step, self.record = total, samples_per_step, record
        self.clock = clock
        self.ticker = Ticker(every_s, clock)
        # (time, step, tokens) at the first step and at each report since, the last few.
        self._marks: deque[tuple[float, int, float]] = deque(maxlen=RATE_REPORTS)
        self.bar: Any = None
        if bar and sys.stderr.isatty():
            self.bar = tqdm(total=total, initial=start_step, desc=f"train {family}", dynamic_ncols=True)

    def step(
        self, step: int, stats: Any, scalars: dict[str, float], tokens_total: float, window: Any
    ) -> None:
        """After step `step` (`stats`: its `StepStats`; `window`: the loop's recent steps)."""
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                loss=figure(float(stats.loss)),
                acc0=figure(float(stats.pos_accuracy()[0]), 2),
                tau=figure(float(stats.acceptance_length_incl_bonus()), 2),
                gn=figure(float(scalars["grad_norm"]), 2),
                tok_s=figure(float(scalars["tokens_per_s"]), 0),
            )
        now = self.clock()
        if not self._marks:
            self._marks.append((now, step, tokens_total))
            self.ticker.due()  # the first report one interval after the first step, or at the last
        if not self.ticker.due(last=step >= self.total):
            return
        t, s, tok = self._marks[0]
        self._marks.append((now, step, tokens_total))
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
        self._say(trainer_progress_line(record))
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
