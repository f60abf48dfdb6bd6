"""The master launcher: bind addresses, ports, lease, log, health check, death with its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from store_fixtures import ROOT, listening, needs_mooncake, small_store_cfg

from hpctoolkit.errors import ConfigError, StoreError
from hpctoolkit.store.mooncake_master import (
    ExternalMaster,
    MasterProcess,
    launch_master,
    pick_free_port,
    resolve_master,
)
from hpctoolkit.store.probe import check_reachable, count_keys_via_master, master_healthy

pytestmark = [pytest.mark.real, needs_mooncake]


@pytest.mark.timeout(60)
def test_launched_master_binds_loopback_auto_ports_lease_and_log(tmp_path):
    cfg = small_store_cfg(kv_lease_ttl_s=1.5)
    with launch_master(cfg, tmp_path) as m:
        assert m.address.startswith("127.0.0.1:") and m.rpc_port != m.metrics_port
        listening_on = listening(m.pid)
        # Both the RPC service and the metrics server on 127.0.0.1; nothing on 0.0.0.0.
        assert ("127.0.0.1", m.rpc_port) in listening_on
        assert ("127.0.0.1", m.metrics_port) in listening_on
        assert all(ip == "127.0.0.1" for ip, _ in listening_on), listening_on
        assert check_reachable(m.address, 5)
        assert master_healthy(m.metrics_address)
        assert count_keys_via_master(m.metrics_address) == 0
        cmd = " ".join(m.command())
        assert "--default_kv_lease_ttl=1500" in cmd and "--metrics_host=127.0.0.1" in cmd
        log = (tmp_path / "mooncake_master.log").read_text()
        assert "default_kv_lease_ttl=1500" in log  # the master's own echo of its settings
    assert not m.alive()


@pytest.mark.timeout(60)
def test_given_ports_are_used(tmp_path):
    rpc, metrics = pick_free_port("127.0.0.1"), pick_free_port("127.0.0.1")
    with launch_master(small_store_cfg(master_port=rpc, metrics_port=metrics), tmp_path) as m:
        assert (m.rpc_port, m.metrics_port) == (rpc, metrics)
        assert m.address == f"127.0.0.1:{rpc}"


@pytest.mark.timeout(60)
def test_resolve_master_launches_iff_address_unset(tmp_path):
    with resolve_master(small_store_cfg(), tmp_path / "a") as own:
        assert isinstance(own, MasterProcess) and own.launched
        given = resolve_master(small_store_cfg(master_address=own.address), tmp_path / "b")
        assert isinstance(given, ExternalMaster) and not given.launched
        assert given.address == own.address
        assert not (tmp_path / "b" / "mooncake_master.log").exists()  # launched none
    dead = f"127.0.0.1:{pick_free_port('127.0.0.1')}"
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=dead):
        resolve_master(small_store_cfg(master_address=dead, connect_timeout_s=3), tmp_path / "c")
    assert time.monotonic() - t0 < 10
    with pytest.raises(ConfigError, match="master_address"):
        resolve_master(small_store_cfg(master_address="no-port"), tmp_path / "d")


@pytest.mark.timeout(60)
def test_taken_port_is_refused_not_shared(tmp_path):
    blocker = launch_master(small_store_cfg(), tmp_path / "first")
    try:
        # mooncake_master binds with SO_REUSEPORT, so a second one on this port would start and
        # silently split the clients; the launcher refuses instead.
        cfg = small_store_cfg(master_port=blocker.rpc_port, metrics_port=pick_free_port("127.0.0.1"))
        with pytest.raises(StoreError, match=f"{blocker.rpc_port}.*already in use"):
            launch_master(cfg, tmp_path / "second")
    finally:
        blocker.stop()


@pytest.mark.timeout(60)
def test_master_that_exits_during_startup_names_its_log(tmp_path):
    fake = tmp_path / "fake_master"
    fake.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(StoreError, match=r"exited with code 3.*mooncake_master.log"):
        MasterProcess(small_store_cfg(), tmp_path, binary=str(fake)).start()
    assert "cannot start" in (tmp_path / "mooncake_master.log").read_text()


_PARENT = """
import sys, time
sys.path.insert(0, {root!r})
import hpctoolkit.store  # noqa
from tests.store_fixtures import small_store_cfg
from hpctoolkit.store.mooncake_master import launch_master
m = launch_master(small_store_cfg(), {log!r})
print(m.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_master_dies_with_its_parent_even_on_sigkill(tmp_path):
    code = _PARENT.format(root=str(ROOT), log=str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdigit(), line
        pid = int(line)
        os.kill(pid, 0)  # alive
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            # A zombie still answers kill(0); it is gone once it has no /proc status of its own.
            status = Path(f"/proc/{pid}/status")
            if status.exists() and "State:\tZ" in status.read_text():
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"mooncake_master {pid} outlived its SIGKILLed parent")
    finally:
        if parent.poll() is None:
            parent.kill()
