"""Launching the Mooncake master that ships in the Mooncake wheel, or connecting to a given one.

The rule (`resolve_master`): when `store.master_address` is unset the run launches its own master;
when it is set the run connects to that address and launches none.

A launched master
    * binds its RPC service and its HTTP metrics server to `store.bind_host` (127.0.0.1 by default,
      never 0.0.0.0 unless the recipe says so; the binary's own default for both is 0.0.0.0);
    * gets free ports unless the recipe names them;
    * takes its object lease TTL from `store.kv_lease_ttl_s`;
    * writes its log to `<log_dir>/mooncake_master.log`;
    * is health-checked (RPC `ServiceReady` and HTTP `/health`) before `launch_master` returns;
    * dies with its parent: PR_SET_PDEATHSIG(SIGKILL) is set in the child, so it goes down even
      when the parent is SIGKILLed. The signal follows the *thread* that started it, so launch
      from a thread that lives as long as the run (the main thread).

Clients use P2PHANDSHAKE metadata, so the master runs no HTTP metadata server and every transfer
connection stays on the interface the clients name.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from hpctoolkit.errors import ConfigError, StoreError
from hpctoolkit.store.config import StoreConfig
from hpctoolkit.store.probe import check_reachable, master_healthy

MASTER_BINARY = "mooncake_master"
LOG_NAME = "mooncake_master.log"
_PR_SET_PDEATHSIG = 1


def find_master_binary() -> str:
    """The `mooncake_master` of this environment: next to the interpreter, in the wheel, on PATH."""
    beside = Path(sys.executable).parent / MASTER_BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
        if spec is not None and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                cand = Path(loc) / MASTER_BINARY
                if cand.is_file() and os.access(cand, os.X_OK):
                    return str(cand)
    except (ImportError, ValueError):
        pass
    found = shutil.which(MASTER_BINARY)
    if found:
        return found
    raise StoreError(
        f"{MASTER_BINARY} not found beside {sys.executable}, in the mooncake package, or on PATH; "
        "install mooncake-transfer-engine-non-cuda (the 'engine' extra)"
    )


def pick_free_port(host: str) -> int:
    """A port that was free on `host` a moment ago (the master may still lose a race for it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR: connections of an earlier master in TIME_WAIT (a requeued job, the next run
        # on the same port) do not count; a live listener still does.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _listener_pids_count(port: int) -> int:
    """How many listening IPv4/IPv6 TCP sockets use `port` on this host (from /proc/net)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) > 3 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                n += 1
    return n


def _die_with_parent_fn() -> Callable[[], None]:
    # Resolved in the parent: dlopen in a child forked from a threaded parent can deadlock.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def _in_child() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # A preemption notice sent to a whole job step (`scancel --signal=USR2`) reaches this
        # child too; its default action would end the store under the run. Ignored survives exec.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        # The parent may have died between fork and prctl; then nobody would deliver the signal.
        if os.getppid() != parent:
            os._exit(1)

    return _in_child


def _lease_ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _fmt_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class MasterProcess:
    """A `mooncake_master` child process. Use `launch_master` or `with MasterProcess(...) as m:`."""

    def __init__(self, cfg: StoreConfig, log_dir: str | os.PathLike[str], *, binary: str | None = None):
        self.cfg = cfg
        self.host = cfg.bind_host
        self.log_dir = Path(log_dir)
        self.log_path = self.log_dir / LOG_NAME
        self.binary = binary or find_master_binary()
        self.rpc_port = 0
        self.metrics_port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.version = ""

    @property
    def address(self) -> str:
        """`host:port` of the RPC service, what clients and `store.master_address` name."""
        return f"{_fmt_host(self.host)}:{self.rpc_port}"

    @property
    def metrics_address(self) -> str:
        """`host:port` of the HTTP metrics server (`/health`, `/metrics`, `/get_all_keys`)."""
        return f"{_fmt_host(self.host)}:{self.metrics_port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def launched(self) -> bool:
        return True

    def command(self) -> list[str]:
        return [
            self.binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            f"--default_kv_lease_ttl={_lease_ms(self.cfg.kv_lease_ttl_s)}",
            "--enable_http_metadata_server=false",
            "--logtostderr=true",
        ]

    def start(self) -> MasterProcess:
        if self.proc is not None:
            raise StoreError(f"Mooncake master at {self.address} is already started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Auto-picked ports can be taken between the probe and the bind; pick again then.
        attempts = 1 if (self.cfg.master_port and self.cfg.metrics_port) else 3
        last: StoreError | None = None
        for _ in range(attempts):
            self.rpc_port = self.cfg.master_port or pick_free_port(self.host)
            self.metrics_port = self.cfg.metrics_port or pick_free_port(self.host)
            while self.metrics_port == self.rpc_port:
                self.metrics_port = pick_free_port(self.host)
            # mooncake_master binds with SO_REUSEPORT: a second master on a taken port starts
            # "fine" and the kernel splits clients between the two. A plain bind detects the taker.
            for name, port in (("master_port", self.rpc_port), ("metrics_port", self.metrics_port)):
                if not _port_is_free(self.host, port):
                    raise StoreError(f"store.{name} {port} on {self.host} is already in use")
            try:
                self._spawn_and_wait()
                return self
            except StoreError as err:
                last = err
                self._reap()
        assert last is not None
        raise last

    def _spawn_and_wait(self) -> None:
        with open(self.log_path, "ab") as logf:
            logf.write(f"# {' '.join(self.command())}\n".encode())
            logf.flush()
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent_fn(),  # noqa: PLW1509 (only prctl, async-signal-safe enough)
                close_fds=True,
            )
        deadline = time.monotonic() + self.cfg.master_startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise StoreError(
                    f"Mooncake master at {self.address} exited with code {self.proc.returncode} during "
                    f"startup; see {self.log_path}"
                )
            try:
                self.version = check_reachable(self.address, timeout_s=1.0)
                ready = master_healthy(self.metrics_address, timeout_s=1.0)
            except StoreError:
                ready = False
            if ready:
                shared = _listener_pids_count(self.rpc_port)
                if shared > 1:
                    raise StoreError(
                        f"Mooncake master at {self.address}: {shared} processes listen on port "
                        f"{self.rpc_port} (SO_REUSEPORT); another master took it during startup"
                    )
                return
            if time.monotonic() > deadline:
                raise StoreError(
                    f"Mooncake master at {self.address} failed its health check within "
                    f"{self.cfg.master_startup_timeout_s:g}s; see {self.log_path}"
                )
            time.sleep(0.05)

    def _reap(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would (fault tests)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`. Idempotent."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> MasterProcess:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ExternalMaster:
    """A master this run did not launch: `.address` only, and `.stop()` does nothing."""

    launched = False

    def __init__(self, cfg: StoreConfig):
        assert cfg.master_address is not None
        self.address = cfg.master_address
        self.metrics_address = cfg.master_metrics_address
        self.cfg = cfg

    def alive(self) -> bool:
        try:
            check_reachable(self.address, self.cfg.connect_timeout_s)
        except StoreError:
            return False
        return True

    def stop(self, timeout_s: float = 5.0) -> None:
        pass

    def __enter__(self) -> ExternalMaster:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def launch_master(
    cfg: StoreConfig, log_dir: str | os.PathLike[str], *, binary: str | None = None
) -> MasterProcess:
    """Start a master per `cfg` (bind host, ports, lease TTL), health-checked before returning."""
    return MasterProcess(cfg, log_dir, binary=binary).start()


def resolve_master(cfg: StoreConfig, log_dir: str | os.PathLike[str]) -> MasterProcess | ExternalMaster:
    """Launch a master iff `store.master_address` is unset; otherwise connect to the given one.

    A given master is checked for reachability (within `connect_timeout_s`) so a wrong address
    fails here, naming it, rather than at the first put.
    """
    try:
        cfg.validate()
    except ConfigError as err:
        raise ConfigError(f"store.{err}") from err
    if cfg.master_address is None:
        return launch_master(cfg, log_dir)
    check_reachable(cfg.master_address, cfg.connect_timeout_s)
    return ExternalMaster(cfg)
