"""The replay spool off the trainer's critical path, and a record rewritten at most once a second.

`SpoolWriter` is a `data.offline.ShardWriter` on a thread of its own. The trainer hands it each
sample it reads (`put`, which blocks only when `max_queued` samples wait: the disk is slower than
training) and goes on; the thread fills shards of `max_shard_bytes` and appends one index line
per shard. `sync()` is the checkpoint's barrier: it returns once every sample put so far is in a
complete shard the index names, so a checkpoint that says "trained on n samples" is written only
after those n are durable, and a resume after a SIGKILL cuts the spool to exactly them
(`offline.keep_first`): none lost, none repeated. A failure on the thread (a full disk) is raised
on the trainer's next `put`, `sync` or `close`, naming the spool (a full disk as a
`rundir.atomic.DiskFullError`, naming the file and the bytes it needed); the samples of a shard
that failed are never named by the index, and nothing is written after the failure.

Memory: at most `max_queued` samples wait in the queue, and at most `max_shard_bytes` of samples
(plus one) wait in the shard being filled; the samples are the reader's own buffers, not copies.

`ThrottledRecord` keeps a small JSON record (a rank's read record: `train.source.LiveSource`)
current to within `min_interval_s` without writing it per sample: `touch()` marks it changed,
and a daemon thread writes it at most once per interval, also while the trainer is blocked waiting
for data (engines' backpressure reads it). `close()` writes the final state.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpctoolkit.data.offline import ShardWriter
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.rundir.atomic import DiskFullError, write_json_atomic

# Shards of this size: one index line and one file creation per few dozen SmolLM2-sized samples,
# small enough that a checkpoint's barrier (which closes the shard being filled) writes little.
DEFAULT_SHARD_BYTES = 256 << 20
DEFAULT_MAX_QUEUED = 16

_ADD, _FLUSH, _CLOSE = "add", "flush", "close"


class SpoolWriter:
    """See the module docstring. One producer thread (the trainer's) calls `put`/`sync`/`close`."""

    def __init__(
        self,
        out_dir: str | Path,
        *,
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
        max_queued: int = DEFAULT_MAX_QUEUED,
    ) -> None:
        self.out_dir = Path(out_dir)
        self._writer = ShardWriter(self.out_dir, max_shard_bytes)
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=max(1, max_queued))
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"spool-{self.out_dir.name}", daemon=True)
        self._thread.start()

    @property
    def durable(self) -> int:
        """Samples in complete shards the index names."""
        return self._writer.samples_written

    @property
    def index_bytes_written(self) -> int:
        return self._writer.index_bytes_written

    def put(self, sample: Any) -> None:
        self._send(_ADD, sample)

    def sync(self) -> None:
        """Return once every sample put so far is durable (the shard being filled is closed)."""
        done = threading.Event()
        self._send(_FLUSH, done)
        self._wait(done)

    def close(self) -> None:
        """Write what is pending, stop the thread; raises what failed on it."""
        if self._closed:
            return
        done = threading.Event()
        self._send(_CLOSE, done)
        self._wait(done)
        self._closed = True
        self._thread.join()

    def _send(self, op: str, arg: Any) -> None:
        if self._closed:
            raise DataIntegrityError(f"spool {self.out_dir} is closed")
        self._raise()
        self._put_until_taken((op, arg))
        self._raise()

    def _put_until_taken(self, item: tuple[str, Any]) -> None:
        while True:
            try:
                self._queue.put(item, timeout=0.5)
                return
            except queue.Full:
                if not self._thread.is_alive():
                    return

    def _wait(self, done: threading.Event) -> None:
        while not done.wait(timeout=0.5):
            if not self._thread.is_alive():
                break
        self._raise()

    def _raise(self) -> None:
        err = self._error
        if isinstance(err, DiskFullError):  # still one, naming the file and the bytes it needed
            raise err.within(f"spool {self.out_dir}") from err
        if err is not None:
            raise DataIntegrityError(f"spool {self.out_dir}: writing a shard failed: {err}") from err

    def _run(self) -> None:
        while True:
            op, arg = self._queue.get()
            if self._error is not None:
                # After a failure nothing more is written; waiters are released to see the error.
                if op in (_FLUSH, _CLOSE):
                    arg.set()
                if op == _CLOSE:
                    return
                continue
            try:
                if op == _ADD:
                    self._writer.add(arg)
                elif op == _FLUSH:
                    self._writer.flush()
                else:
                    self._writer.close()
            except BaseException as err:  # noqa: BLE001  -- raised on the trainer's thread (`_raise`)
                self._error = err
            if op in (_FLUSH, _CLOSE):
                arg.set()
            if op == _CLOSE:
                return


class ThrottledRecord:
    """A JSON record rewritten at most every `min_interval_s`; see the module docstring."""

    def __init__(self, path: Path, render: Callable[[], dict[str, Any]], min_interval_s: float = 1.0) -> None:
        self.path = path
        self._render = render
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._stop = threading.Event()
        self.writes = 0
        self._write()
        self._thread = threading.Thread(target=self._run, name=f"record-{path.name}", daemon=True)
        self._thread.start()

    @property
    def lock(self) -> threading.Lock:
        """Held while the record is rendered: take it to change what `render` reads."""
        return self._lock

    def touch(self) -> None:
        self._dirty.set()

    def close(self) -> None:
        """Stop the thread and write the final state."""
        self._stop.set()
        self._dirty.set()
        self._thread.join()
        self._write()

    def _write(self) -> None:
        with self._lock:
            rec = self._render()
        write_json_atomic(self.path, rec)
        self.writes += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._dirty.wait()
            if self._stop.is_set():
                return
            self._dirty.clear()
            t0 = time.monotonic()
            with contextlib.suppress(OSError):  # a progress record: the next write (or `close`) tries again
                self._write()
            self._stop.wait(max(0.0, self.min_interval_s - (time.monotonic() - t0)))
