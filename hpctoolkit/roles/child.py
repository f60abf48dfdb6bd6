"""Run one phase in a fresh spawned process and bring back its result or its error.

vLLM does not release its workers (or its torch.distributed group) within a process, and the
trainer sets up its own process group, so capture, training and evaluation each get a process.
The child's result travels back as JSON in a file; an exception comes back with its type name and
message, and is re-raised in the parent as the same error class when it is one of ours. Any other
exception becomes a one-line `ChildFailedError`; the child's traceback goes to the parent's stderr
(the role's log), not into the message.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpctoolkit import errors
from hpctoolkit.cli import dump_stacks_on_sigusr1, one_line
from hpctoolkit.rundir.atomic import write_json_atomic


def _entry(fn: Callable[..., Any], args: tuple, result_path: str) -> None:
    dump_stacks_on_sigusr1()
    try:
        result = fn(*args)
        payload = {"ok": True, "result": result}
    except BaseException as err:  # noqa: BLE001 -- every failure must reach the parent
        payload = {
            "ok": False,
            "type": type(err).__name__,
            "message": str(err),
            "traceback": traceback.format_exc(),
        }
    # Whole or absent: the parent may read it while this process is still exiting.
    write_json_atomic(result_path, payload)


class ChildFailedError(errors.RoleFailedError):
    """A phase's process failed. The message is one line naming the phase and its error; the
    child's traceback was printed to this process's stderr (the role's log)."""


class Child:
    """A phase running in its own process. `result()` waits and returns or re-raises."""

    def __init__(self, name: str, fn: Callable[..., Any], args: tuple, workdir: Path):
        self.name = name
        self.result_path = workdir / f".{name}.result.json"
        self.result_path.unlink(missing_ok=True)
        self.proc = mp.get_context("spawn").Process(
            target=_entry, args=(fn, args, str(self.result_path)), name=f"hpctoolkit-{name}"
        )
        self.proc.start()

    def alive(self) -> bool:
        return self.proc.is_alive()

    def result(self, timeout: float | None = None, linger_s: float | None = None) -> Any:
        """Wait for the phase's result (up to `timeout`). With `linger_s`, a child that wrote its
        result but is still exiting after `linger_s` more is ended with what it started: vLLM's
        exit-time shutdown of an engine spanning nodes can wait forever on the other nodes."""
        if linger_s is None:
            self.proc.join(timeout)
        else:
            deadline = None if timeout is None else time.monotonic() + timeout
            while self.proc.is_alive() and not self.result_path.is_file():
                if deadline is not None and time.monotonic() > deadline:
                    break
                self.proc.join(0.5)
            self.proc.join(linger_s if self.result_path.is_file() else 0)
            if self.proc.is_alive() and self.result_path.is_file():
                self.kill_tree()
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
            raise ChildFailedError(f"{self.name} phase did not finish within {timeout:.0f}s and was killed")
        if not self.result_path.is_file():
            raise ChildFailedError(
                f"{self.name} phase died with exit code {self.proc.exitcode} and left no result"
            )
        payload = json.loads(self.result_path.read_text())
        if payload["ok"]:
            return payload["result"]
        cls = getattr(errors, payload["type"], None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            raise cls(payload["message"])
        print(
            f"traceback of the {self.name} phase (process {self.proc.pid}):\n{payload['traceback']}",
            end="" if payload["traceback"].endswith("\n") else "\n",
            file=sys.stderr,
            flush=True,
        )
        raise ChildFailedError(
            f"{self.name} phase failed: {payload['type']}: {one_line(payload['message'])} "
            "(its traceback is in this role's log)"
        )

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()

    def kill_tree(self) -> None:
        """End the child and every process it started (vLLM's workers); nothing if it is gone."""
        import psutil

        if not self.proc.is_alive():
            return
        try:
            procs = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            procs = []
        self.kill()
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
