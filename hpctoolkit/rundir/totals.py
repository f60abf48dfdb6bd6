"""What a live run's records say it moved: the samples the engines published (their queues'
`.done` records) and what the trainer ranks read (their read records), for rank 0's summary.

Records of an earlier attempt (another run prefix) count as absent.

Once training ended, rank 0 waits for the other ranks' records (`wait_read_totals`), bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hpctoolkit.rundir.atomic import read_json
from hpctoolkit.rundir.layout import RunDir


def published(run: RunDir, prefixes: Sequence[str]) -> int | None:
    """Samples every engine published, or None while any engine's queue of this attempt is open."""
    total = 0
    for i, prefix in enumerate(prefixes):
        rec = read_json(run.queue_done(i))
        if not isinstance(rec, dict) or rec.get("run_prefix") != prefix:
            return None
        total += int(rec["published"])
    return total


def read_totals(records: Sequence[Path], prefixes: Sequence[str]) -> tuple[int, int, bool]:
    """(samples, bytes, every rank complete) from the ranks' read records of this attempt."""
    n = nbytes = 0
    complete = True
    for path in records:
        rec = read_json(path) or {}
        if rec.get("prefixes", list(prefixes)) != list(prefixes):
            rec = {}  # an earlier attempt's
        n += int(rec.get("samples", 0))
        nbytes += int(rec.get("bytes", 0))
        complete = complete and bool(rec.get("complete"))
    return n, nbytes, complete


def wait_read_totals(
    records: Sequence[Path],
    prefixes: Sequence[str],
    published: int | None,
    *,
    wait: bool,
    drained: Callable[[], bool],
    timeout_s: float,
) -> tuple[int, int]:
    """(samples, bytes) the ranks read, once every rank's record is complete, or `drained()` says
    every rank read its share, or every published sample was read, or after `timeout_s`; at once
    unless `wait` (one rank: its own record is written)."""
    deadline = time.monotonic() + timeout_s
    read, moved, complete = read_totals(records, prefixes)
    # A rank's record is complete once its stream ended; one whose steps took exactly its share
    # never asks for more, so every published sample read also ends the wait (it held a job that
    # read all it published, K3's own counts, for the whole timeout).
    while (
        not complete
        and not drained()
        and wait
        and (published is None or read < published)
        and time.monotonic() < deadline
    ):
        time.sleep(0.5)
        read, moved, complete = read_totals(records, prefixes)
    return read, moved
