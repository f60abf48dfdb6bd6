"""Every role of a multi-host run watches the other hosts of the job over the data-plane network,
and every other role process of the job, so a host whose link goes down, or a role that dies
without a word (SIGKILL, the OOM killer), ends the run in seconds, naming that host or role,
instead of leaving its peers blocked in a collective or a put until some transport timeout an hour
later.

Each role process listens on its node's address (`Probe`, any port) and records the port and its
role in the run directory (`hosts/n<k>.<pid>.probe`). A watcher connects to every other role
process's probe once a second (its own host's too). What that says is `rundir.alive.role_state`'s
rule: an accepted connection is a live role; a refused one means the host answers but the process
is gone, which is a death when the role's record (`rundir.alive`) says it never left and, after
`DEAD_ROUNDS` rounds, its probe record is still there (a role that leaves records how, then closes
its probe, then removes the probe record); a timeout or an unreachable route from every probe of a
host, `MISSES` rounds in a row, means the host is lost. This host's own link going down is told
apart (its interface is down) and named as such.

On a loss the watcher records it under `faults/`, prints the one line (a death: only the first to
claim it, `rundir.alive.claim_death`; the others stop with a line that points there), interrupts
the role (which unwinds and ends what it started) and, should the role be stuck in a C call that
never returns (a gloo collective), ends its process group after `GRACE_S`.
"""

from __future__ import annotations

import _thread
import contextlib
import errno
import fcntl
import os
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from hpctoolkit.plan.lifecycle import STOP_GRACE_S, role_key
from hpctoolkit.roles.context import NodeContext
from hpctoolkit.rundir import alive
from hpctoolkit.rundir.atomic import write_json_atomic

PERIOD_S = 1.0
CONNECT_TIMEOUT_S = 1.0
MISSES = 4
# Rounds a probe must refuse, its record still there, before its role is called dead.
DEAD_ROUNDS = 2
# Ending the role's process group: SIGTERM, then SIGKILL after the lifecycle's one grace.
GRACE_S = STOP_GRACE_S
_SIOCGIFFLAGS = 0x8913
_IFF_UP = 0x1
_IFF_RUNNING = 0x40


def link_up(ifname: str) -> bool:
    """Whether `ifname` is up and running in this network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return False
    flags = struct.unpack("H", raw[16:18])[0]
    return bool(flags & _IFF_UP and flags & _IFF_RUNNING)


def connect(address: str, port: int) -> str:
    """What a TCP connect to address:port did within the timeout: `alive.ACCEPTED` (a process
    listens), `alive.REFUSED` (the host is there, nothing listens) or `alive.SILENT`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(CONNECT_TIMEOUT_S)
        try:
            code = s.connect_ex((address, port))
        except OSError:
            return alive.SILENT
    return {0: alive.ACCEPTED, errno.ECONNREFUSED: alive.REFUSED}.get(code, alive.SILENT)


def answers(address: str, port: int) -> bool:
    """The host at `address` answered a connect to `port` (accepted or refused)."""
    return connect(address, port) != alive.SILENT


class Probe:
    """This process's listener on its node's address; accepts and closes, nothing else."""

    def __init__(self, ctx: NodeContext, key: str = ""):
        self.sock = socket.create_server((ctx.host_address.address, 0))
        self.port = self.sock.getsockname()[1]
        self.record = ctx.run.root / "hosts" / f"n{ctx.node}.{os.getpid()}.probe"
        # `key`: the role's record (`rundir.alive`), which says whether it left.
        write_json_atomic(self.record, {"address": ctx.host_address.address, "port": self.port, "key": key})
        threading.Thread(target=self._serve, name="hpctoolkit-probe", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        self.sock.close()
        self.record.unlink(missing_ok=True)


@dataclass(frozen=True)
class _ProbeRecord:
    path: Path
    address: str
    port: int
    key: str


def _probes(root: Path, node: int, skip_pid: int | None = None) -> list[_ProbeRecord]:
    import json

    out = []
    for path in sorted((root / "hosts").glob(f"n{node}.*.probe")):
        if skip_pid is not None and path.name == f"n{node}.{skip_pid}.probe":
            continue
        try:
            rec = json.loads(path.read_text())
            out.append(_ProbeRecord(path, str(rec["address"]), int(rec["port"]), str(rec.get("key", ""))))
        except (OSError, ValueError, KeyError):
            continue
    return out


class PeerWatch:
    """Watch every other node of the plan and every other role process; on a loss, end this role
    with one line naming the host or the role."""

    def __init__(self, ctx: NodeContext):
        self.ctx = ctx
        self.lost: str | None = None
        self._stop = threading.Event()
        self._misses: dict[int, int] = {}
        self._seen: dict[int, list[_ProbeRecord]] = {}
        self._refused: dict[Path, int] = {}
        # Roles whose probe refused `DEAD_ROUNDS` rounds while their record said they never left.
        self._gone: set[str] = set()
        # The role whose death this watch found (named in this role's end record, `rundir.alive`).
        self.cause: str | None = None
        self._thread = threading.Thread(target=self._run, name="hpctoolkit-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _dead(self, probe: _ProbeRecord, state: str) -> str | None:
        """The line for a role whose probe refused `DEAD_ROUNDS` rounds while its record says it
        never left and its probe record stayed (a clean exit removes it)."""
        root = self.ctx.run.root
        record = alive.RoleRecord.read(alive.record_path(root, probe.key)) if probe.key else None
        if alive.role_state(state, record) != alive.DEAD or record is None:
            self._refused.pop(probe.path, None)
            return None
        self._refused[probe.path] = self._refused.get(probe.path, 0) + 1
        if self._refused[probe.path] < DEAD_ROUNDS or not probe.path.exists():
            return None
        self._gone.add(probe.key)
        # The first of the run's roles to end is the cause: one ended with a failure of its own
        # makes the others' deaths (srun ending them) no news; an earlier silent one is the death.
        # Only roles known gone count: a live one that is starved (it holds the GIL in a long C
        # call on a loaded host) stops beating too, and its old beat would take it for the cause.
        keys = [role_key(p) for p in self.ctx.plan.processes()]
        records = alive.read_records(root, keys)
        first = alive.culprit(records, ended=self._gone)
        dead = records.get(first) if first else None
        if dead is None:
            return "stopping: another role of the run failed (its error line says how)"
        how = f"its process {dead.pid} is gone, no end record"
        if dead.key == record.key:
            how += f"; nothing listens on {probe.address}:{probe.port}"
        if alive.claim_death(root, dead.key, dead.role, dead.host, how, by=self.ctx.nodename):
            self.cause = dead.key
            # Not the run's died line: in a batch job the batch script says that one from the
            # claim (this role's own output may be cut off as srun ends its step).
            return f"stopping: {dead.role} (node {dead.host}) is dead ({how})"
        claim = alive.claimed(root)
        self.cause = str(claim["key"]) if claim and claim.get("key") in keys else dead.key
        return f"stopping: another role of the run is dead ({alive.died_path(root)} names it)"

    def _check(self, node: int) -> str | None:
        own = node == self.ctx.node
        probes = _probes(self.ctx.run.root, node, os.getpid() if own else None)
        if not probes and not own:
            probes = self._seen.get(node, [])  # its roles' records are gone: still ask
        if not probes:
            return None  # its roles have not started yet (or this is the only one here)
        self._seen[node] = probes
        states = [(p, connect(p.address, p.port)) for p in probes]
        for p, state in states:
            dead = self._dead(p, state)
            if dead:
                return dead
        if own or any(state != alive.SILENT for _, state in states):
            self._misses[node] = 0
            return None
        self._misses[node] = self._misses.get(node, 0) + 1
        if self._misses[node] < MISSES:
            return None
        ifname = self.ctx.host_address.ifname
        if not link_up(ifname):
            return (
                f"this host ({self.ctx.nodename}, {self.ctx.host_address.address}) lost its link on "
                f"cluster.network ({ifname} is down)"
            )
        return (
            f"host {self.ctx.host(node)} ({probes[0].address}, node n{node}) stopped answering on "
            f"cluster.network for {MISSES * PERIOD_S:.0f}s"
        )

    def verdict(self, timeout_s: float = (MISSES + 2) * (PERIOD_S + CONNECT_TIMEOUT_S)) -> str | None:
        """After the role failed: was a host lost, or did a role die? Watch until one is (its
        reason) or every other host answered in one round with no death pending (None), at most
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.lost is None and time.monotonic() < deadline:
            reasons = [self._check(n) for n in range(self.ctx.plan.num_nodes)]
            lost = next((r for r in reasons if r), None)
            if lost:
                return lost
            if all(self._misses.get(n, 0) == 0 for n in self._seen) and not self._refused:
                return None
            time.sleep(PERIOD_S)
        return self.lost

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            for node in range(self.ctx.plan.num_nodes):
                reason = self._check(node)
                if reason:
                    self._fail(reason)
                    return

    def _fail(self, reason: str) -> None:
        self.lost = reason
        write_json_atomic(
            self.ctx.run.root / "faults" / f"lost-n{self.ctx.node}-{os.getpid()}.json",
            {"reporter": self.ctx.nodename, "reason": reason, "at": time.time()},
        )
        _thread.interrupt_main()
        if self._stop.wait(GRACE_S):
            return
        # Still running: stuck in a call that does not return. End the process group.
        print(f"error: StoreError: {reason}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            os.killpg(os.getpgid(0), signal.SIGKILL)
