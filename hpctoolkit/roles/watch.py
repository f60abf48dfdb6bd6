"""Every role of a multi-host run watches the other hosts of the job over the data-plane network,
so a host whose link goes down ends the run in seconds, naming that host, instead of leaving its
peers blocked in a collective or a put until some transport timeout an hour later.

Each role process listens on its node's address (`Probe`, any port) and records the port in the run
directory (`hosts/n<k>.<pid>.probe`). A watcher connects to every other node's probes once a
second: an accepted or a refused connection means the host answers (a refusal: its role is gone,
the host is not); a timeout or an unreachable route, `MISSES` rounds in a row, means it is lost.
This host's own link going down is told apart (its interface is down) and named as such.

On a loss the watcher records it under `faults/`, prints the one line, interrupts the role (which
unwinds and ends what it started) and, should the role be stuck in a C call that never returns
(a gloo collective), ends its process group after `GRACE_S`.
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
from pathlib import Path

from hpctoolkit.roles.context import NodeContext
from hpctoolkit.rundir.atomic import write_json_atomic

PERIOD_S = 1.0
CONNECT_TIMEOUT_S = 1.0
MISSES = 4
GRACE_S = 15.0
_SIOCGIFFLAGS = 0x8913
_IFF_UP = 0x1
_IFF_RUNNING = 0x40
_ANSWERED = (0, errno.ECONNREFUSED)


def link_up(ifname: str) -> bool:
    """Whether `ifname` is up and running in this network namespace."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return False
    flags = struct.unpack("H", raw[16:18])[0]
    return bool(flags & _IFF_UP and flags & _IFF_RUNNING)


def answers(address: str, port: int) -> bool:
    """A TCP connect to address:port is accepted or refused within the timeout (the host is there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(CONNECT_TIMEOUT_S)
        try:
            return s.connect_ex((address, port)) in _ANSWERED
        except OSError:
            return False


class Probe:
    """This process's listener on its node's address; accepts and closes, nothing else."""

    def __init__(self, ctx: NodeContext):
        self.sock = socket.create_server((ctx.host_address.address, 0))
        self.port = self.sock.getsockname()[1]
        self.record = ctx.run.root / "hosts" / f"n{ctx.node}.{os.getpid()}.probe"
        write_json_atomic(self.record, {"address": ctx.host_address.address, "port": self.port})
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


def _probes(root: Path, node: int) -> list[tuple[str, int]]:
    import json

    out = []
    for path in (root / "hosts").glob(f"n{node}.*.probe"):
        try:
            rec = json.loads(path.read_text())
            out.append((str(rec["address"]), int(rec["port"])))
        except (OSError, ValueError, KeyError):
            continue
    return out


class PeerWatch:
    """Watch every other node of the plan; on a loss, end this role with one line naming the host."""

    def __init__(self, ctx: NodeContext):
        self.ctx = ctx
        self.lost: str | None = None
        self._stop = threading.Event()
        self._misses: dict[int, int] = {}
        self._seen: dict[int, tuple[str, int]] = {}
        self._thread = threading.Thread(target=self._run, name="hpctoolkit-peer-watch", daemon=True)

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _check(self, node: int) -> str | None:
        probes = _probes(self.ctx.run.root, node) or ([self._seen[node]] if node in self._seen else [])
        if not probes:
            return None  # its roles have not started yet
        self._seen[node] = probes[0]
        if any(answers(a, p) for a, p in probes):
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
            f"host {self.ctx.host(node)} ({probes[0][0]}, node n{node}) stopped answering on "
            f"cluster.network for {MISSES * PERIOD_S:.0f}s"
        )

    def verdict(self, timeout_s: float = (MISSES + 2) * (PERIOD_S + CONNECT_TIMEOUT_S)) -> str | None:
        """After the role failed: was a host lost? Watch until one is (its reason) or every other
        host answered in one round (None), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.lost is None and time.monotonic() < deadline:
            reasons = [self._check(n) for n in range(self.ctx.plan.num_nodes) if n != self.ctx.node]
            lost = next((r for r in reasons if r), None)
            if lost:
                return lost
            if all(self._misses.get(n, 0) == 0 for n in self._seen):
                return None
            time.sleep(PERIOD_S)
        return self.lost

    def _run(self) -> None:
        others = [n for n in range(self.ctx.plan.num_nodes) if n != self.ctx.node]
        while not self._stop.wait(PERIOD_S):
            for node in others:
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
