"""Atomic writes: a reader on any node sees the old file or the new one, never half of either.

The content goes to a temporary name in the same directory (`.<name>.tmp-<pid>-<thread>`, so
concurrent writers never share one), is flushed to disk, then `os.replace`d over the target (and
the directory synced); on any failure the temporary file is removed and the target is left as it was. Every JSON record,
index, marker and weights file of a run is written through here: text with `write_text_atomic` /
`write_json_atomic`, bytes with `write_bytes_atomic`, and anything a library writes to a path
(safetensors, a hand-rolled shard) through `atomic_path`. Read back, a record is `read_json` (None
until it exists); a JSON file the user names (a config) is `read_json_object`, which fails in one
`ConfigError` line naming the file. A build into a shared cache (a target) takes turns with other
processes under `exclusive`.

A full disk (ENOSPC) or a spent quota (EDQUOT) is a `DiskFullError`: one line naming the path and
the bytes the write needed, with the temporary file removed and the old file in place. `disk_full`
turns what a library raised for it (an `OSError`, or its own error carrying the errno's text:
safetensors, torch's zip writer, `torch.distributed.checkpoint`) into one; writers that know what a
whole artifact needs (a shard, a checkpoint, a converted target) name it instead of one file.

Pure standard library: `models` and `train` use it on machines without vllm or mooncake.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpctoolkit.config.fields import read_text
from hpctoolkit.errors import ConfigError, DataIntegrityError

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(DataIntegrityError, OSError):
    """A write found its filesystem full or its quota spent. The message is one line naming the
    path, the bytes the write needed and those free there. A data-path fault (the run fails, exit
    1, and resumes from what was complete); also an `OSError` (errno ENOSPC or EDQUOT), so what
    retried or tolerated a failed write before still does."""

    def __init__(
        self,
        message: str,
        path: str | os.PathLike[str],
        needed: int | None,
        code: int,
        estimate: bool = False,
    ):
        super().__init__(message)
        self.errno = code
        self.filename = str(path)
        self.needed = needed
        self.estimate = estimate

    def __str__(self) -> str:  # the line itself, not OSError's "[Errno 28] ..." form
        return str(self.args[0])

    def __reduce__(self) -> tuple[Any, ...]:  # whole across processes (spawned ranks)
        return (type(self), (str(self), self.filename, self.needed, self.errno, self.estimate))

    def within(self, what: str) -> DiskFullError:
        """The same fault, its line led by `what` (the artifact the file belongs to)."""
        code = self.errno or errno.ENOSPC
        return DiskFullError(
            f"{what}: {self}", Path(self.filename), self.needed, code, estimate=self.estimate
        )


def _chain(err: BaseException) -> Iterator[BaseException]:
    """`err` and every error it wraps: causes, contexts, and the per-rank failures of
    torch.distributed.checkpoint's CheckpointException."""
    todo: list[BaseException | None] = [err]
    seen: set[int] = set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def _full_errno(err: BaseException) -> int | None:
    """ENOSPC or EDQUOT where `err`, or what it wraps, reports a full disk; else None. Libraries
    that lose the errno keep its text (safetensors: "... (os error 28)")."""
    for e in _chain(err):
        if isinstance(e, OSError) and e.errno in FULL_ERRNOS:
            return e.errno
        text = str(e)
        for code in FULL_ERRNOS:
            if os.strerror(code) in text or f"(os error {code})" in text:
                return code
    return None


# Writers that report a short write without its errno: torch's zip writer (`torch.save` into a
# file, and so `torch.distributed.checkpoint`) checks its position after the write that ran out of
# room ("unexpected pos 704 vs 598") or fails the write itself ("file write failed"). Seen on a
# 2-core CI machine (2026-12-07), where the checkpoint test saw the first instead of ENOSPC.
SHORT_WRITE_TEXTS = ("unexpected pos ", "file write failed")


def _short_write(err: BaseException) -> bool:
    return any(t in str(e) for e in _chain(err) for t in SHORT_WRITE_TEXTS)


def _free_bytes(path: Path) -> int | None:
    p = path
    while not p.exists() and p.parent != p:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def disk_full(
    err: BaseException,
    path: str | os.PathLike[str],
    needed: int | None = None,
    *,
    estimate: bool = False,
    written: int | None = None,
) -> DiskFullError | None:
    """The `DiskFullError` naming `path` when `err` reports a full disk or quota, else None.
    `needed`: the bytes the write needs (`estimate`: about that many); unknown, an inner
    `DiskFullError`'s figure is kept, else `written` (bytes it wrote before failing) is a lower bound."""
    target = Path(path)
    code = _full_errno(err)
    if code is None and needed is not None and _short_write(err):
        # The errno was lost on the way: a full disk only where the write cannot fit now (what the
        # failed write left has been removed by then), else the error stands as it was raised.
        free = _free_bytes(target)
        if free is not None and free < needed:
            code = errno.ENOSPC
    if code is None:
        return None
    if needed is None and isinstance(err, DiskFullError) and err.needed is not None:
        needed, estimate = err.needed, err.estimate
    if needed is not None:
        amount = f"{'about ' if estimate else ''}{needed} bytes"
    elif written:
        amount = f"more than the {written} bytes it had written"
    else:
        amount = "more bytes"
    free = _free_bytes(target)
    there = "" if free is None else f", {free} bytes are free there"
    message = (
        f"{os.strerror(code)} writing {target}: it needed {amount}{there}; free space (or raise the quota) "
        "and run again: what was complete is kept and the run resumes from it"
    )
    return DiskFullError(message, target, needed, code, estimate=estimate)


def _bytes_of(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def _tmp_name(target: Path) -> Path:
    return target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")


def _fsync(path: Path) -> None:
    # The writer may not have synced (safetensors does not): the rename must not land first.
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    # The rename itself is durable only once its directory is (a crash may otherwise undo it).
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename stands either way
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike[str], *, sync: bool = True, nbytes: int | None = None
) -> Iterator[Path]:
    """Yield a temporary path next to `path` (parent directories are created) to write the whole
    file to; on a clean exit it is synced (unless the writer did: `sync=False`) and renamed over
    `path`, on an exception removed. A full disk is a `DiskFullError` naming `path` and `nbytes`
    (the file's size, where the caller knows it)."""
    target = Path(path)
    tmp = _tmp_name(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        if sync:
            _fsync(tmp)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException as err:
        if isinstance(err, DiskFullError):
            raise  # an inner write named its own file
        written = _bytes_of(tmp)
        tmp.unlink(missing_ok=True)  # before the free bytes are counted
        full = disk_full(err, target, nbytes, written=written)
        if full is None:
            raise
        raise full from err
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def exclusive(lock_path: str | os.PathLike[str]) -> Iterator[None]:
    """Hold an exclusive `flock` on `lock_path` (created if missing, never removed: removing it
    would race a process about to take it). Processes building one thing into a shared cache take
    turns under it, each checking again, once it holds the lock, whether another built it."""
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write `data` to `path` atomically (parent directories are created); returns the path."""
    with atomic_path(path, sync=False, nbytes=len(data)) as tmp, tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return Path(path)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write `text` to `path` atomically (parent directories are created); returns the path."""
    return write_bytes_atomic(path, text.encode())


def write_json_atomic(
    path: str | os.PathLike[str], record: Any, *, indent: int | None = None, sort_keys: bool = False
) -> Path:
    """`record` as JSON (one line unless `indent`; values JSON cannot hold as `str`),
    newline-terminated, written atomically."""
    return write_text_atomic(path, json.dumps(record, indent=indent, sort_keys=sort_keys, default=str) + "\n")


def read_json(path: str | os.PathLike[str]) -> Any | None:
    """The JSON record at `path`, or None while it does not exist (or is not JSON yet)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_json_object(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """The JSON object in the file at `path`, a file the user named (`what`: the key or kind that
    named it). Raises `ConfigError`, one line naming `what` and the file, when it is missing, not
    JSON, or not an object."""
    p = Path(path)
    text = read_text(p, what)  # missing, unreadable or not UTF-8: one line naming it
    try:
        data = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{what}: {p} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: {p} must hold a JSON object")
    return data
