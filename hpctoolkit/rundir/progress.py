"""A role's progress while it runs: a line for people and a small record in the run directory, at a
steady interval.

`Ticker(every_s)` says when to report: at the first chance, then at most once per `every_s` of
wall time, and always at the last unit of work; a fast run gets a handful of lines, a run of hours
one every `every_s`, whatever its step rate. `Counted` is a Ticker over a count of `total` units
(evaluate's questions) with its ETA. `write_progress` writes the record (`RunDir.progress`,
`progress/<role>.json`) atomically, with the wall-clock `time` it was written, so a reader on any
node sees a whole record and can tell how old it is (`python -m hpctoolkit.status`).

Records are metadata only, full precision; the line rounds (`hpctoolkit.output.figures`).
Pure standard library: the training loop uses it on the GPU machine.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from hpctoolkit.output.figures import duration, figure, rate
from hpctoolkit.rundir.atomic import write_json_atomic

# Seconds between two progress reports unless the recipe says otherwise.
DEFAULT_EVERY_S = 10.0


class Ticker:
    """`due(last=...)`: whether to report now (see the module docstring); `clock` is for tests."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_s, clock
        self._next: float | None = None

    def due(self, *, last: bool = False) -> bool:
        now = self.clock()
        if not last and self._next is not None and now < self._next:
            return False
        self._next = now + self.every_s
        return True


class Counted:
    """`counted(n)`: `n` more of `total` done; at the interval (and at the last) `emit(record)`
    with `{"role", "what", "done", "total", "eta_s"}`. The ETA runs from the first unit done, so
    a start-up before it (an engine loading) does not count as work."""

    def __init__(
        self,
        role: str,
        what: str,
        total: int,
        every_s: float,
        emit: Callable[[dict[str, Any]], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        self.role, self.what, self.total, self.emit, self.clock = role, what, total, emit, clock
        self.done = 0
        self.ticker = Ticker(every_s, clock)
        self.ticker.due()  # the first report after one interval, or at the last
        self._first: tuple[float, int] | None = None

    def __call__(self, n: int) -> None:
        self.done += n
        now = self.clock()
        self._first = self._first or (now, self.done)
        if not self.ticker.due(last=self.done >= self.total):
            return
        t, d = self._first
        per_s = (self.done - d) / max(now - t, 1e-9)
        eta = (self.total - self.done) / per_s if per_s > 0 else None
        self.emit(
            {"role": self.role, "what": self.what, "done": self.done, "total": self.total, "eta_s": eta}
        )


def write_progress(path: str | os.PathLike[str], record: Mapping[str, Any], now: float | None = None) -> None:
    """`record` plus `time` (seconds since the epoch), written atomically to `path`."""
    write_json_atomic(path, {**record, "time": time.time() if now is None else now})


def trainer_progress_line(r: Mapping[str, Any]) -> str:
    """A trainer record for people: `step 40/800 (5%), loss 3.642, tau 1.940, 12.3 samples/s, 1234
    tokens/s, ETA 1m35s` (`train.reporter` writes the record, `hpctoolkit.status` reads it back)."""
    step, total = r.get("step"), r.get("total")
    pct = f" ({100 * step // total}%)" if isinstance(step, int) and isinstance(total, int) and total else ""
    return (
        f"step {step}/{total}{pct}, loss {figure(r.get('loss'))}, tau {figure(r.get('tau'))}, "
        f"{rate(r.get('samples_per_s'))} samples/s, "
        f"{rate(r.get('tokens_per_s'))} tokens/s, ETA {duration(r.get('eta_s'))}"
    )


def count_line(r: Mapping[str, Any]) -> str:
    """A count record for people (evaluate's): `questions 12/80 (15%), ETA 2m10s`."""
    done, total = r.get("done"), r.get("total")
    pct = f" ({100 * done // total}%)" if isinstance(done, int) and isinstance(total, int) and total else ""
    eta = f", ETA {duration(r['eta_s'])}" if r.get("eta_s") is not None else ""
    return f"{r.get('what', 'done')} {done}/{total}{pct}{eta}"
