"""Backpressure: an engine leader pauses capture while its store segments fill up unread.

Each PP stage of an engine publishes from one writer, into that writer's own segment of
`store.global_segment_size` (`plan.sizing`). The leader knows the bytes it published per stage
(from the manifests it appends to its queue), and the trainer ranks record the bytes of each
engine's samples they read, per stage (`read-rank<r>.json`, `train.source.LiveSource`): unread =
published - read, per stage, an upper bound (a sample counts as read only after it was fetched and
removed). Between capture batches the leader waits while the fullest segment is above
`store.backpressure_high` of its size, until it is below `store.backpressure_low`, instead of
letting puts fail on a full segment. The wait is bounded (`store.backpressure_max_pause_s`) and
ends with an error when the trainers stop reading (`drained`) while samples are left to capture.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.plan.sizing import fmt_bytes


class Backpressure:
    """One engine's gate between capture batches. `read_bytes()` returns the bytes per stage the
    trainers have read; `drained()` whether they stopped reading."""

    def __init__(
        self,
        engine: int,
        pp_size: int,
        segment_bytes: int,
        high: float,
        low: float,
        max_pause_s: float,
        read_bytes: Callable[[], Sequence[int]],
        drained: Callable[[], bool],
        say: Callable[[str], None],
        poll_s: float = 0.2,
    ) -> None:
        self.engine, self.pp_size, self.segment_bytes = engine, pp_size, segment_bytes
        self.high, self.low, self.max_pause_s = high, low, max_pause_s
        self.read_bytes, self.drained, self.say, self.poll_s = read_bytes, drained, say, poll_s
        self.published_bytes = [0] * pp_size
        self.pauses = 0
        self.paused_s = 0.0

    def published(self, manifest: Any) -> None:
        for s in range(self.pp_size):
            self.published_bytes[s] += sum(f.nbytes for f in manifest.fragments_of_stage(s))

    def unread(self) -> list[int]:
        read = list(self.read_bytes())
        return [max(0, p - (read[s] if s < len(read) else 0)) for s, p in enumerate(self.published_bytes)]

    def _fullest(self) -> tuple[int, int]:
        unread = self.unread()
        stage = max(range(self.pp_size), key=lambda s: unread[s])
        return stage, unread[stage]

    def wait(self, stop: threading.Event | None = None) -> float:
        """Return at once while the fullest segment is below the high watermark; else pause until
        it is below the low one. Returns the seconds paused."""
        stage, unread = self._fullest()
        if unread < self.high * self.segment_bytes:
            return 0.0
        t0 = time.monotonic()
        self.pauses += 1
        self.say(
            f"engine {self.engine}: backpressure: pausing capture, stage {stage}'s segment holds "
            f"{fmt_bytes(unread)} unread of {fmt_bytes(self.segment_bytes)} (high watermark {self.high:g})"
        )
        while True:
            time.sleep(self.poll_s)
            stage, unread = self._fullest()
            if unread < self.low * self.segment_bytes:
                waited = time.monotonic() - t0
                self.paused_s += waited
                self.say(
                    f"engine {self.engine}: backpressure: resuming capture after {waited:.1f}s, stage "
                    f"{stage}'s segment holds {fmt_bytes(unread)} unread (low watermark {self.low:g})"
                )
                return waited
            if stop is not None and stop.is_set():
                raise DataIntegrityError(f"engine {self.engine} stopped while paused by backpressure")
            if self.drained():
                raise DataIntegrityError(
                    f"engine {self.engine}: the trainers stopped reading (drained) with {fmt_bytes(unread)} "
                    f"unread in stage {stage}'s segment and samples left to capture"
                )
            if time.monotonic() - t0 > self.max_pause_s:
                raise DataIntegrityError(
                    f"engine {self.engine}: paused by backpressure for more than store.backpressure_max_pause_s="
                    f"{self.max_pause_s:g}s: stage {stage}'s segment still holds {fmt_bytes(unread)} unread"
                )


def for_engine(ctx: Any, engine: int, say: Callable[[str], None], prefix: str | None = None) -> Backpressure:
    """Engine `engine`'s gate in a run (`roles.context.NodeContext`): the trainers' read records
    in the run's spool directory (those of its key `prefix` when given), the drained record, the
    store section's watermarks."""
    from hpctoolkit.rundir.atomic import read_json
    from hpctoolkit.train.source import read_stage_bytes

    cfg, plan = ctx.cfg, ctx.plan
    pp = plan.engines[engine].pp
    world = plan.trainer.world_size

    def drained() -> bool:
        rec = read_json(ctx.run.drained)
        return isinstance(rec, dict) and rec.get("run_id") == ctx.run_id

    s = cfg.store
    return Backpressure(
        engine,
        pp,
        s.global_segment_size,
        s.backpressure_high,
        s.backpressure_low,
        s.backpressure_max_pause_s,
        lambda: read_stage_bytes(ctx.run.spool, world, engine, pp, prefix),
        drained,
        say,
    )
