"""SIGUSR2, the preemption notice: finish the step, checkpoint, leave.

Slurm sends SIGUSR2 `cluster.signal_before_s` before the time limit (the batch script forwards it
to the trainers), and a user or a scheduler may send it at any time (`scancel --signal=USR2`).
The handler only records the request; the training loop looks at it between steps, where every
rank agrees through one collective whether any rank was asked, and then all of them write one
checkpoint of the step they finished (`train/loop.py`).

A rank may be waiting for its next samples when the signal comes (the engines have not published
them yet, or stopped capturing). Only there, inside `interruptible()`, the handler raises
`Preempted`, which ends the wait; the samples of the unfinished batch were never trained on, so
they are not in the checkpoint's ledger and the next attempt captures them again.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_requested = threading.Event()
_state = {"reading": False, "installed": False}


class Preempted(Exception):  # noqa: N818 - a notice, not an error
    """SIGUSR2 arrived while this rank waited for samples."""


def _handler(signum, frame) -> None:
    _requested.set()
    if _state["reading"]:
        _state["reading"] = False
        raise Preempted("SIGUSR2 while waiting for samples")


def install() -> None:
    """Handle SIGUSR2 in this process (idempotent; a no-op outside the main thread)."""
    if _state["installed"] or threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGUSR2, _handler)
    _state["installed"] = True


def requested() -> bool:
    return _requested.is_set()


def request() -> None:
    """What the signal does, for tests that preempt a loop without a signal."""
    _requested.set()


def reset() -> None:
    _requested.clear()


@contextmanager
def interruptible() -> Iterator[None]:
    """A wait the preemption notice may end (with `Preempted`)."""
    if _requested.is_set():
        raise Preempted("SIGUSR2 before waiting for samples")
    _state["reading"] = True
    try:
        yield
    finally:
        _state["reading"] = False
