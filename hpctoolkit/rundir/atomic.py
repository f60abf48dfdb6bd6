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

Pure standard library: `models` and `train` use it on machines without vllm or mooncake.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpctoolkit.config.fields import read_text
from hpctoolkit.errors import ConfigError


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
def atomic_path(path: str | os.PathLike[str], *, sync: bool = True) -> Iterator[Path]:
    """Yield a temporary path next to `path` (parent directories are created) to write the whole
    file to; on a clean exit it is synced (unless the writer did: `sync=False`) and renamed over
    `path`, on an exception removed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(target)
    try:
        yield tmp
        if sync:
            _fsync(tmp)
        os.replace(tmp, target)
        _fsync_dir(target.parent)
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
    with atomic_path(path, sync=False) as tmp, tmp.open("wb") as f:
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
