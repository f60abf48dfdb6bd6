"""Atomic writes: a reader on any node sees the old file or the new one, never half of either.

The text goes to a temporary name in the same directory (unique per process and thread), is
flushed, then `os.replace`d over the target. Every JSON record, index and marker of a run is
written through here.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` atomically (parent directories are created); returns the path."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def write_json_atomic(path: str | os.PathLike, record: Any, *, indent: int | None = None) -> Path:
    """`record` as JSON (one line unless `indent`), newline-terminated, written atomically."""
    return write_text_atomic(path, json.dumps(record, indent=indent, default=str) + "\n")


def read_json(path: str | os.PathLike) -> Any | None:
    """The JSON record at `path`, or None while it does not exist (or is not JSON yet)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
