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

    def _write(self, left: str | None, cause: str | None = None) -> None:
        alive.write_record(
            self.ctx.run.root, self.key, self.role, self.ctx.node, self.ctx.nodename, os.getpid(), left, cause
        )

    def _beat(self) -> None:
        while not self._stop.wait(alive.HEARTBEAT_S):
            alive.beat(self.path)

    def leave(self, how: str, cause: str | None = None) -> None:
        """Record how this role left (the first call counts) and stop beating. `cause`: the role
        whose death this one failed of (its watch found it gone), so the run names that role."""
        if self.left is not None:
            return
        self.left = how
        self._stop.set()
        self._write(how, cause)

    def _on_term(self, signum: int, _frame: FrameType | None) -> None:
        self.leave(f"signal {signum}")
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


# The guard: a tiny process that outlives this one by an instant and ends what it left behind.
# It ignores what Slurm and the launchers send a step's processes (a step's end goes to every one),
# so only this process's death (PR_SET_PDEATHSIG, a signal nobody else sends) sets it off. It ends
# the members of the group that carry this task's SLURM_LOCALID (or none, as this process): a Slurm
# step puts all of a node's tasks in task 0's group, and task 0's end must not kill its siblings
# (submitit's tasks, which outlive it by the time they take to hand back their results).
_GUARD = r"""
import ctypes, os, signal, sys
parent, group, localid = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT):
    signal.signal(s, signal.SIG_IGN)
def ours(pid):
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
        if int(stat[stat.rindex(b")") + 2:].split()[2]) != group:
            return False
        with open("/proc/%d/environ" % pid, "rb") as f:
            env = f.read().split(b"\0")
    except (OSError, ValueError, IndexError):
        return False
    ids = [e[14:] for e in env if e.startswith(b"SLURM_LOCALID=")]
    return (ids[0].decode() if ids else "") == localid
def end(*_):
    for _ in range(3):  # again, for what forked while the first pass ran
        for name in os.listdir("/proc"):
            if name.isdigit() and int(name) != os.getpid() and ours(int(name)):
                try:
                    os.kill(int(name), signal.SIGKILL)
                except OSError:
                    pass
    os._exit(0)
death = signal.SIGRTMIN + 1
signal.signal(death, end)
ctypes.CDLL(None, use_errno=True).prctl(1, int(death), 0, 0, 0)
if os.getppid() != parent:
    end()
while True:
    signal.pause()
"""


def guard_process_group() -> bool:
    """Make this role's process group end with it: vLLM's engine core and workers, the Mooncake
    master binary, whatever it started, once it dies however it dies (SIGKILL included; a role
    that leaves ends them itself first). Only for a process that leads its own group (each role of
    the embedded launcher, task 0 of each node's share of a step), so no other process's group is
    ever ended; in a step's group only this task's processes (its SLURM_LOCALID) are."""
    import subprocess
    import sys

    if os.getpgid(0) != os.getpid():
        return False
    subprocess.Popen(
        [
            sys.executable,
            "-S",
            "-c",
            _GUARD,
            str(os.getpid()),
            str(os.getpgid(0)),
            os.environ.get("SLURM_LOCALID", ""),
        ],
        # Nothing of the role's output: a launcher reading it to its end must not wait on this.
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        close_fds=True,
    )
    return True
