"""Manifest queues: how engine leaders hand manifests to the trainers of a Slurm run.

Control plane only (metadata, never tensors), in the run's directory (`hpctoolkit.rundir.layout`), which every
node of the job shares. Files under `<run>/manifests/`:

* `engine<i>.jsonl`: engine i's manifests, one JSON object per line, appended and flushed per line
  by its leader (`QueueWriter.append`); a line is complete once its newline is written.
* `engine<i>.done`: `{"run_prefix": ..., "published": n}`, written atomically after the last line.
* `engine<i>.failed`: `{"run_prefix": ..., "error": ...}` when the leader's capture failed.
* `drained`: `{"run_id": ...}` from trainer rank 0 once every rank read its whole share; the
  leaders then release their store segments (the fragments live there until then).

Every record carries the engine's run prefix (unique per run and engine, `engine.run_prefix`), so
files an earlier run left in the same output directory are told apart from this run's: a leader
removes its engine's stale files before it starts, and a reader waits while a queue still shows an
earlier run's first line, and fails once this run's lines are followed by a foreign one.

`follow_queues` yields the manifests of all engines in one order every trainer rank agrees on:
round-robin by engine index (engine 0's line 0, engine 1's line 0, engine 0's line 1, ...), an
engine leaving the rotation once its done record's count is reached. Every wait is bounded and
names what it waited for; a failed engine, a count that disagrees, or a stall raises
`DataIntegrityError` (never a silently shorter sample set).
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.rundir.atomic import write_json_atomic
from hpctoolkit.rundir.layout import RunDir


def _run(run_root: str | os.PathLike[str]) -> RunDir:
    root = Path(run_root)
    return RunDir(root.parent, root.name)


def queue_dir(run_root: str | os.PathLike[str]) -> Path:
    return _run(run_root).manifests


def queue_path(run_root: str | os.PathLike[str], engine: int) -> Path:
    return _run(run_root).queue(engine)


def done_path(run_root: str | os.PathLike[str], engine: int) -> Path:
    return _run(run_root).queue_done(engine)


def failed_path(run_root: str | os.PathLike[str], engine: int) -> Path:
    return _run(run_root).queue_failed(engine)


def drained_path(run_root: str | os.PathLike[str]) -> Path:
    return _run(run_root).drained


def _write_atomic(path: Path, record: dict[str, Any]) -> None:
    write_json_atomic(path, record)


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _key_of(line: str, where: str) -> str:
    try:
        key = json.loads(line)["sample_key"]
    except (ValueError, KeyError, TypeError) as err:
        raise DataIntegrityError(f"{where}: not a manifest line ({err}): {line[:120]!r}") from None
    if not isinstance(key, str):
        raise DataIntegrityError(f"{where}: sample_key is not a string: {line[:120]!r}")
    return key


class QueueWriter:
    """Engine `engine`'s side of its queue (the leader's process only)."""

    def __init__(self, output_dir: str | os.PathLike[str], engine: int, run_prefix: str):
        self.output_dir = Path(output_dir)
        self.engine = engine
        self.run_prefix = run_prefix
        self.published = 0

    def reset(self) -> None:
        """Remove what an earlier run left for this engine; call before capturing."""
        queue_dir(self.output_dir).mkdir(parents=True, exist_ok=True)
        for path in (
            done_path(self.output_dir, self.engine),
            failed_path(self.output_dir, self.engine),
            queue_path(self.output_dir, self.engine),
        ):
            path.unlink(missing_ok=True)
        queue_path(self.output_dir, self.engine).touch()

    def append(self, manifest_json: str) -> None:
        key = _key_of(manifest_json, f"engine {self.engine}")
        if not key.startswith(self.run_prefix + "-"):
            raise DataIntegrityError(
                f"sample {key} does not carry engine {self.engine}'s prefix {self.run_prefix}"
            )
        with queue_path(self.output_dir, self.engine).open("a") as f:
            f.write(manifest_json.strip() + "\n")
            f.flush()
        self.published += 1

    def done(self) -> None:
        _write_atomic(
            done_path(self.output_dir, self.engine),
            {"run_prefix": self.run_prefix, "published": self.published},
        )

    def failed(self, error: str) -> None:
        _write_atomic(
            failed_path(self.output_dir, self.engine), {"run_prefix": self.run_prefix, "error": error}
        )


class _Queue:
    """A reader's position in one engine's queue."""

    def __init__(self, output_dir: Path, engine: int, prefix: str, expected: int | None):
        self.output_dir, self.engine, self.prefix, self.expected = output_dir, engine, prefix, expected
        self.path = queue_path(output_dir, engine)
        self.offset = 0
        self.seen = 0
        # A deque: a trainer that starts behind a fast capture takes thousands of lines in order.
        self.lines: deque[str] = deque()
        self.published: int | None = None

    @property
    def finished(self) -> bool:
        return self.published is not None and self.seen >= self.published

    def poll(self) -> None:
        """Read new complete lines; check the done and failed records."""
        failed = _read_record(failed_path(self.output_dir, self.engine))
        if failed and failed.get("run_prefix") == self.prefix:
            raise DataIntegrityError(f"engine {self.engine} failed: {failed.get('error')}")
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        end = chunk.rfind(b"\n")
        if end >= 0:
            for raw in chunk[: end + 1].decode().splitlines():
                if not raw.strip():
                    continue
                key = _key_of(raw, str(self.path))
                if not key.startswith(self.prefix + "-"):
                    if self.seen == 0 and not self.lines:
                        # An earlier run's queue the leader has not replaced yet: read it again.
                        self.offset = 0
                        return
                    raise DataIntegrityError(
                        f"{self.path}: sample {key} after {self.seen} of this run's ({self.prefix}) samples "
                        "belongs to another run; give each run its own paths.output_dir"
                    )
                self.lines.append(raw)
            self.offset += end + 1
        done = _read_record(done_path(self.output_dir, self.engine))
        if done and done.get("run_prefix") == self.prefix:
            self.published = int(done["published"])
            if self.expected is not None and self.published != self.expected:
                raise DataIntegrityError(
                    f"engine {self.engine} reports {self.published} samples published, expected {self.expected}"
                )
            if self.seen + len(self.lines) > self.published:
                raise DataIntegrityError(
                    f"{self.path} holds more lines ({self.seen + len(self.lines)}) than engine {self.engine} "
                    f"reports published ({self.published})"
                )

    def take(self) -> str | None:
        if not self.lines:
            return None
        self.seen += 1
        return self.lines.popleft()


def follow_queues(
    output_dir: str | os.PathLike[str],
    run_prefixes: Sequence[str],
    *,
    expected: Sequence[int] | None = None,
    stall_timeout_s: float = 1800.0,
    poll_s: float = 0.1,
) -> Iterator[str]:
    """Yield every engine's manifest lines, round-robin by engine, until each engine is done.

    `run_prefixes[i]` is engine i's run prefix; `expected[i]`, when given, the count engine i must
    report. Raises `DataIntegrityError` when an engine failed, counts disagree, or no new line
    arrived for `stall_timeout_s` (naming the queues still waited on).
    """
    out = Path(output_dir)
    queues = [
        _Queue(out, i, p, None if expected is None else int(expected[i])) for i, p in enumerate(run_prefixes)
    ]
    last_progress = time.monotonic()
    turn = 0
    while True:
        live = [q for q in queues if not q.finished]
        if not live:
            return
        q = queues[turn % len(queues)]
        if q.finished:
            turn += 1
            continue
        line = q.take()
        if line is None:
            q.poll()
            line = q.take()
        if line is not None:
            last_progress = time.monotonic()
            turn += 1
            yield line
            continue
        if q.finished:
            turn += 1
            continue
        if time.monotonic() - last_progress > stall_timeout_s:
            waiting = ", ".join(
                f"{x.path} ({x.seen} read"
                + (f" of {x.published})" if x.published is not None else ", no done record)")
                for x in live
            )
            raise DataIntegrityError(f"no new manifest for {stall_timeout_s:.0f}s; waiting on {waiting}")
        time.sleep(poll_s)


def wait_drained(output_dir: str | os.PathLike[str], run_id: str, timeout_s: float, stop: Any = None) -> None:
    """Block until trainer rank 0 wrote this run's `drained` record (or `stop`, an Event, is set)."""
    path = drained_path(output_dir)
    deadline = time.monotonic() + timeout_s
    while True:
        rec = _read_record(path)
        if rec and rec.get("run_id") == run_id:
            return
        if stop is not None and stop.is_set():
            raise DataIntegrityError(f"stopped while waiting for the trainers to drain ({path})")
        if time.monotonic() > deadline:
            raise DataIntegrityError(f"the trainers did not write {path} within {timeout_s:.0f}s")
        time.sleep(0.2)


def write_drained(output_dir: str | os.PathLike[str], run_id: str) -> None:
    queue_dir(output_dir).mkdir(parents=True, exist_ok=True)
    _write_atomic(drained_path(output_dir), {"run_id": run_id})
