"""This role process's record of itself (`rundir.alive`): written at start, touched every
`HEARTBEAT_S` by a thread, and told how the role left before the process closes anything a peer
could see (its probe, its step). A role killed outright leaves the record saying it never left.

A SIGTERM (srun ending a step, the embedded launcher ending a role) to a role that installed no
handler of its own (the trainers) is recorded as how it left, then does what it did before: ends
the process. Roles that handle SIGTERM themselves (`roles.waits.term_event`) unwind, and leave
through `leave`.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from hpctoolkit.plan.lifecycle import role_key, role_label
from hpctoolkit.plan.placement import Process
from hpctoolkit.roles.context import NodeContext
from hpctoolkit.rundir import alive


class Heartbeat:
    def __init__(self, ctx: NodeContext, proc: Process):
        self.ctx, self.key, self.role = ctx, role_key(proc), role_label(proc)
        self.path = alive.record_path(ctx.run.root, self.key)
        self.left: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="hpctoolkit-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._write(None)
        self._thread.start()
        if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, self._on_term)
        return self

    def _write(self, left: str | None) -> None:
        alive.write_record(
            self.ctx.run.root, self.key, self.role, self.ctx.node, self.ctx.nodename, os.getpid(), left
        )

    def _beat(self) -> None:
        while not self._stop.wait(alive.HEARTBEAT_S):
            alive.beat(self.path)

    def leave(self, how: str) -> None:
        """Record how this role left (the first call counts) and stop beating."""
        if self.left is not None:
            return
        self.left = how
        self._stop.set()
        self._write(how)

    def _on_term(self, signum: int, _frame: FrameType | None) -> None:
        self.leave(f"signal {signum}")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
