"""Rank 0's progress while it trains: the tqdm bar (the role's log), and at a steady interval
(`training.progress_every_s`, and at the last step) one `[hpctoolkit.trainer]` line, which the
launcher copies to the console, and the record `progress/trainer.json` of a run directory, which
`python -m hpctoolkit.status` reads (`rundir.progress`).

The rates are over the steps since the previous report (the first: since training started), so
the ETA follows the current pace rather than one slowed by the first steps' compilation.
"""

from __future__ import annotations

import time
from typing import Any

from hpctoolkit.roles.console import speaker
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
        self.ticker.due()  # the first report comes after one interval, or at the last step
        self._mark = (time.monotonic(), start_step, 0.0)  # (time, step, tokens) at the last report
        self.bar: Any = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start_step, desc=f"train {family}", dynamic_ncols=True)

    def step(self, step: int, loss: float, tokens_total: float, postfix: dict[str, str]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(**postfix)
        if not self.ticker.due(last=step >= self.total):
            return
        now = time.monotonic()
        t, s, tok = self._mark
        dt = max(now - t, 1e-9)
        steps_per_s = (step - s) / dt
        record = {
            "role": "trainer",
            "step": step,
            "total": self.total,
            "loss": loss,
            "samples_per_s": steps_per_s * self.samples_per_step,
            "tokens_per_s": (tokens_total - tok) / dt,
            "eta_s": (self.total - step) / steps_per_s if steps_per_s > 0 else None,
        }
        self._mark = (now, step, tokens_total)
        say(trainer_line(record))
        if self.record:
            write_progress(self.record, record)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
