"""A dead role told from one that left (`rundir.alive`), the watch's liveness rule on real sockets
(`roles.watch`), a role's own record (`roles.heartbeat`), and the lifecycle's names and bounds for
it (`plan.lifecycle`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpctoolkit.plan import lifecycle
from hpctoolkit.plan.placement import make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.roles.context import NodeContext
from hpctoolkit.roles.network import HostAddress
from hpctoolkit.roles.watch import DEAD_ROUNDS, PeerWatch, connect
from hpctoolkit.rundir import alive, ledger
from hpctoolkit.rundir.atomic import write_json_atomic
from hpctoolkit.rundir.layout import RunDir

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "tests" / "recipes" / "multihost.yaml"


def rec(key: str, left: str | None, beat: float) -> alive.RoleRecord:
    return alive.RoleRecord(key, key, 0, "host1", 1, left, beat)


@pytest.mark.parametrize(
    ("connect_", "left", "want"),
    [
        (alive.ACCEPTED, None, alive.LIVE),
        (alive.ACCEPTED, "ok", alive.LIVE),
        (alive.REFUSED, None, alive.DEAD),  # the host answers, the process is gone, it never left
        (alive.REFUSED, "ok", alive.LEFT),
        (alive.REFUSED, "failed", alive.LEFT),
        (alive.REFUSED, "signal 15", alive.LEFT),
        (alive.SILENT, None, alive.UNANSWERED),  # the host is the question
        (alive.SILENT, "ok", alive.LEFT),
    ],
)
def test_liveness_rule(connect_, left, want):
    assert alive.role_state(connect_, rec("x", left, 1.0)) == want


def test_a_refused_probe_without_a_record_is_no_live_peer():
    # The old rule took any answer from the host (a refusal too) for a live peer.
    assert alive.role_state(alive.REFUSED, None) == alive.DEAD
    assert alive.role_state(alive.REFUSED, None) != alive.LIVE


def test_culprit_is_the_first_to_end_when_that_end_was_a_death():
    # trainer1 killed (last beat 10.0); trainer0 ended by srun after it (beat 10.4): trainer1.
    assert alive.culprit({"trainer0": rec("t0", None, 10.4), "trainer1": rec("t1", None, 10.0)}) == "trainer1"
    # trainer1 failed with its own line first (10.0); trainer0 killed by srun after: nobody died.
    assert alive.culprit({"trainer0": rec("t0", None, 10.4), "trainer1": rec("t1", "failed", 10.0)}) is None
    # trainer1 killed first; trainer0 then failed on the broken collective: trainer1 died.
    assert (
        alive.culprit({"trainer0": rec("t0", "failed", 10.2), "trainer1": rec("t1", None, 10.0)})
        == "trainer1"
    )
    # Left well, or ended by a signal: never the cause.
    assert alive.culprit({"a": rec("a", "ok", 1.0), "b": rec("b", "signal 15", 2.0)}) is None
    # No record: dies first only when a signal ended its step.
    assert alive.culprit({"a": None, "b": rec("b", None, 5.0)}) == "b"
    assert alive.culprit({"a": None, "b": rec("b", None, 5.0)}, missing_died=True) == "a"
    assert alive.culprit({}) is None


def test_a_death_is_claimed_once(tmp_path):
    assert alive.claim_death(tmp_path, "engine0-0", "engine 0 leader", "host3", "signal 9", by="a")
    assert not alive.claim_death(tmp_path, "trainer1", "trainer rank 1", "host2", "signal 9", by="b")
    assert alive.claimed(tmp_path)["key"] == "engine0-0"
    assert (
        alive.died_line("engine 0 leader", "host3", "signal 9")
        == "engine 0 leader (node host3) died (signal 9)"
    )


def test_lifecycle_names_roles_and_steps():
    cfg = load_recipe(RECIPE, [])
    plan = make_plan(cfg)
    keys = [lifecycle.role_key(p) for p in plan.processes()]
    labels = [lifecycle.role_label(p) for p in plan.processes()]
    assert keys == ["master", "engine0-0", "engine0-1", "trainer0", "trainer1"]
    assert labels == [
        "master",
        "engine 0 leader",
        "engine 0 follower (node_rank 1)",
        "trainer rank 0",
        "trainer rank 1",
    ]
    assert [lifecycle.role_key(p) for p in lifecycle.step_processes(plan, "trainer")] == [
        "trainer0",
        "trainer1",
    ]
    assert [lifecycle.role_key(p) for p in lifecycle.step_processes(plan, "engine0-1")] == ["engine0-1"]
    assert lifecycle.step_processes(plan, "nope") == ()
    assert [lifecycle.how_ended(s) for s in (137, -9, 1)] == ["signal 9", "signal 9", "exit status 1"]
    # A death ends the job well within the bound docs/slurm.md states; the watch polls within it.
    assert lifecycle.WATCH_POLL_S < lifecycle.DEATH_BOUND_S <= 90


def test_a_new_attempt_clears_the_last_ones_role_records(tmp_path):
    run = RunDir.of(tmp_path, "r-j1")
    alive.write_record(run.root, "trainer0", "trainer rank 0", 0, "host1", 1, None)
    write_json_atomic(
        run.root / "hosts" / "n0.1.probe", {"address": "127.0.0.1", "port": 1, "key": "trainer0"}
    )
    alive.claim_death(run.root, "trainer0", "trainer rank 0", "host1", "signal 9", by="x")
    assert ledger.begin_attempt(run, "1", 1)
    assert not list(alive.alive_dir(run.root).glob("*.json"))
    assert not list((run.root / "hosts").glob("*.probe"))
    assert alive.claimed(run.root) is None


def _ctx(tmp_path: Path, node: int) -> NodeContext:
    cfg = load_recipe(RECIPE, [f"paths.output_dir={tmp_path}"])
    run = RunDir.of(tmp_path, "multihost-j1")
    hosts = ("host1", "host2", "host3", "host4")
    return NodeContext(
        cfg, make_plan(cfg), node, hosts, hosts[node], None, run, HostAddress("lo", "127.0.0.1")
    )


def _peer(ctx: NodeContext, key: str, node: int, pid: int, left: str | None = None) -> socket.socket:
    """A role process of another node, as its records and probe show it (a real listening socket)."""
    sock = socket.create_server(("127.0.0.1", 0))
    label = {"engine0-0": "engine 0 leader", "trainer1": "trainer rank 1"}[key]
    alive.write_record(ctx.run.root, key, label, node, ctx.host(node), pid, left)
    probe = {"address": "127.0.0.1", "port": sock.getsockname()[1], "key": key}
    write_json_atomic(ctx.run.root / "hosts" / f"n{node}.{pid}.probe", probe)
    return sock


def test_the_watch_names_a_peer_whose_process_is_gone_once(tmp_path):
    ctx = _ctx(tmp_path, 0)
    sock = _peer(ctx, "engine0-0", 2, 4242)
    watch = PeerWatch(ctx)
    assert connect("127.0.0.1", sock.getsockname()[1]) == alive.ACCEPTED
    assert watch._check(2) is None  # live
    sock.close()  # SIGKILL: the kernel closes its socket; its records stay as they were
    reasons = [watch._check(2) for _ in range(DEAD_ROUNDS)]
    assert reasons[:-1] == [None] * (DEAD_ROUNDS - 1)
    assert reasons[-1].startswith(
        "stopping: engine 0 leader (node host3) is dead (its process 4242 is gone, no end record"
    )
    assert json.loads(alive.died_path(ctx.run.root).read_text())["key"] == "engine0-0"
    # Another watcher (trainer rank 1's, on host2) does not name it again.
    other = PeerWatch(_ctx(tmp_path, 1))
    last = [other._check(2) for _ in range(DEAD_ROUNDS)][-1]
    assert last is not None and "died (" not in last and "names it" in last


def test_the_batch_script_says_a_watchers_claim_once(tmp_path, monkeypatch, capsys):
    # The engine leader's watch claimed the master's death, then srun ended its step before its
    # own line reached the output: the batch script's `roles died` says the run's one line, once
    # however many failed steps ask.
    from hpctoolkit.plan import lifecycle
    from hpctoolkit.roles.verdict import run_died

    ctx = _ctx(tmp_path, 0)
    assert alive.claim_death(ctx.run.root, "master", "master", "host1", "its process 9 is gone", by="host3")
    monkeypatch.setenv("HPCTOOLKIT_FAILED_STEP", lifecycle.TRAINER_STEP)
    monkeypatch.setenv("HPCTOOLKIT_FAILED_STATUS", "1")
    assert run_died(ctx) == 0 and run_died(ctx) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if " died (" in x]
    assert said == ["hpctoolkit: master (node host1) died (its process 9 is gone)"]


def test_the_watch_lets_a_peer_that_left_go(tmp_path):
    ctx = _ctx(tmp_path, 0)
    sock = _peer(ctx, "engine0-0", 2, 4242, left="ok")
    sock.close()  # the leader left after the drain: its record says so, then its probe closed
    watch = PeerWatch(ctx)
    assert all(watch._check(2) is None for _ in range(DEAD_ROUNDS + 2))
    assert alive.claimed(ctx.run.root) is None


def test_the_watch_names_no_death_when_a_role_failed_first(tmp_path):
    # Trainer rank 1 failed with its own error line; srun then killed rank 0 (node 0): rank 0's
    # probe refuses and its record never left, but it is no cause.
    ctx = _ctx(tmp_path, 1)
    alive.write_record(ctx.run.root, "trainer1", "trainer rank 1", 1, "host2", 7, "failed")
    os.utime(alive.record_path(ctx.run.root, "trainer1"), (100.0, 100.0))
    sock = socket.create_server(("127.0.0.1", 0))
    alive.write_record(ctx.run.root, "trainer0", "trainer rank 0", 0, "host1", 8, None)
    probe = {"address": "127.0.0.1", "port": sock.getsockname()[1], "key": "trainer0"}
    write_json_atomic(ctx.run.root / "hosts" / "n0.8.probe", probe)
    sock.close()
    watch = PeerWatch(ctx)
    last = [watch._check(0) for _ in range(DEAD_ROUNDS)][-1]
    assert last == "stopping: another role of the run failed (its error line says how)"
    assert alive.claimed(ctx.run.root) is None


HEARTBEAT_CHILD = """
import os, signal, sys, time
from hpctoolkit.roles.heartbeat import Heartbeat
from hpctoolkit.roles.context import NodeContext
ctx = NodeContext(*__import__("pickle").loads(bytes.fromhex(sys.argv[1])))
from hpctoolkit.plan.placement import Process
hb = Heartbeat(ctx, Process("trainer", 1, (), None, 1, 0)).start()
print("up", flush=True)
time.sleep(30)
"""


def test_a_role_ended_by_sigterm_says_so_and_still_ends(tmp_path):
    import pickle

    ctx = _ctx(tmp_path, 1)
    args = (ctx.cfg, ctx.plan, ctx.node, ctx.hosts, ctx.nodename, None, ctx.run, ctx.host_address)
    child = subprocess.Popen(
        [sys.executable, "-c", HEARTBEAT_CHILD, pickle.dumps(args).hex()], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "up\n"
        path = alive.record_path(ctx.run.root, "trainer1")
        first = alive.RoleRecord.read(path)
        assert first is not None and first.left is None and first.role == "trainer rank 1"
        time.sleep(4 * alive.HEARTBEAT_S)
        assert alive.RoleRecord.read(path).beat > first.beat  # it beats
        child.send_signal(signal.SIGTERM)
        assert child.wait(10) == -signal.SIGTERM
    finally:
        child.kill()
    assert alive.RoleRecord.read(path).left == "signal 15"


GUARDED_CHILD = """
import subprocess, sys, time
from hpctoolkit.roles.heartbeat import guard_process_group
assert guard_process_group()
child = subprocess.Popen(["sleep", "60"])
print(child.pid, flush=True)
time.sleep(60)
"""


def test_what_a_killed_role_started_ends_with_it():
    """The guard ends a role's process group once the role is killed outright (vLLM's engine core
    and workers would otherwise outlive it); it ignores the SIGTERM a step's end sends them all."""
    role = subprocess.Popen(
        [sys.executable, "-c", GUARDED_CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert role.stdout is not None
        grandchild = int(role.stdout.readline())
        guard = [p for p in _children(role.pid) if p != grandchild]
        assert len(guard) == 1
        deadline = time.monotonic() + 10
        while not _ignores_sigterm(guard[0]) and time.monotonic() < deadline:
            time.sleep(0.05)  # its interpreter is starting
        os.kill(guard[0], signal.SIGTERM)  # as srun's step end: the guard stays
        time.sleep(0.5)
        assert _alive(guard[0]) and _alive(grandchild)
        role.kill()
        role.wait(10)
        deadline = time.monotonic() + 10
        while (_alive(grandchild) or _alive(guard[0])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(grandchild) and not _alive(guard[0])
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(role.pid, signal.SIGKILL)


def test_a_killed_task_0_leaves_its_sibling_tasks_alone():
    """A Slurm step puts a node's tasks in task 0's process group. Task 0's guard ends what task 0
    started, and never a sibling task (SLURM_LOCALID 1), which would fail a step whose tasks all
    succeeded (submitit's tasks outlive task 0 while they hand back their results)."""
    role = subprocess.Popen(
        [sys.executable, "-c", GUARDED_CHILD], stdout=subprocess.PIPE, text=True, process_group=0,
        env={**os.environ, "SLURM_LOCALID": "0"},
    )  # fmt: skip
    sibling = None
    try:
        assert role.stdout is not None
        grandchild = int(role.stdout.readline())
        sibling = subprocess.Popen(
            ["sleep", "60"], process_group=role.pid, env={**os.environ, "SLURM_LOCALID": "1"}
        )
        assert os.getpgid(sibling.pid) == role.pid
        guard = [p for p in _children(role.pid) if p != grandchild]
        deadline = time.monotonic() + 10
        while not _ignores_sigterm(guard[0]) and time.monotonic() < deadline:
            time.sleep(0.05)  # its interpreter is starting
        role.kill()
        role.wait(10)
        deadline = time.monotonic() + 10
        while (_alive(grandchild) or _alive(guard[0])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(grandchild) and not _alive(guard[0])
        assert sibling.poll() is None, "task 0's guard killed its sibling task"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(role.pid, signal.SIGKILL)
        if sibling is not None:
            sibling.kill()
            sibling.wait()


def _children(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _ignores_sigterm(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


def test_the_embedded_launcher_names_a_role_killed_outright(tmp_path):
    from hpctoolkit.roles.local import RoleProcess

    p = RoleProcess(
        "engine0",
        ["bash", "-c", "echo starting; kill -9 $$"],
        dict(os.environ),
        tmp_path / "engine0.log",
        tmp_path / "engine0.failure.json",
    )
    assert p.proc.wait(10) == -signal.SIGKILL
    err = p.failure()
    assert str(err).startswith("engine0 died (signal 9; log ")
    p.stop()
