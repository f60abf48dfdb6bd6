"""Which role the run names when a role dies (`rundir.alive.culprit`, pure: records in, verdict
out), as the peers' watches (`roles.watch`) and the batch script (`roles.verdict`) ask it.

Issue 44: the master was killed during the trainers' phase on a loaded 2-core machine, and the run
named trainer rank 1, alive but starved (its heartbeat thread held off the GIL), whose last beat was
older than the master's. A beat orders deaths; it never makes one.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from hpctoolkit.plan.placement import make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.roles.context import NodeContext
from hpctoolkit.roles.network import HostAddress
from hpctoolkit.roles.watch import DEAD_ROUNDS, PeerWatch
from hpctoolkit.rundir import alive
from hpctoolkit.rundir.atomic import write_json_atomic
from hpctoolkit.rundir.layout import RunDir

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "tests" / "recipes" / "multihost.yaml"
KEYS = ("master", "engine0-0", "engine0-1", "trainer0", "trainer1")
# The master is killed at 10.0: its last beat.
KILLED_AT = 10.0


def rec(key: str, left: str | None, beat: float, cause: str | None = None) -> alive.RoleRecord:
    return alive.RoleRecord(key, key, 0, "host1", 1, left, beat, cause)


def live(beat: float = KILLED_AT + 2.0) -> dict[str, alive.RoleRecord | None]:
    """Every role up and beating; the master killed at KILLED_AT."""
    records: dict[str, alive.RoleRecord | None] = {k: rec(k, None, beat) for k in KEYS}
    records["master"] = rec("master", None, KILLED_AT)
    return records


# --- a watch found the master's process gone (its probe refuses) -------------------------------


def test_the_watch_names_the_master_not_a_starved_trainer():
    # Trainer rank 1 holds the GIL in a long C call: its last beat (9.0) is older than the
    # master's, but its process is there. Only the master is known gone.
    records = live() | {"trainer1": rec("trainer1", None, KILLED_AT - 1.0)}
    assert alive.culprit(records, ended={"master"}) == "master"
    # What the watch did before: every role that never said it left counted as dead.
    assert alive.culprit(records) == "trainer1"


def test_of_the_roles_known_gone_the_first_to_stop_beating_is_the_cause():
    records = live() | {"trainer1": rec("trainer1", None, KILLED_AT + 0.5)}
    assert alive.culprit(records, ended={"master", "trainer1"}) == "master"
    assert alive.culprit(records, ended={"trainer1"}) == "trainer1"


def test_a_failure_before_the_death_is_the_run_s_own_error_line():
    # An engine failed with its own error (9.0) before the master was found gone: no death named.
    records = live() | {"engine0-0": rec("engine0-0", alive.FAILED, KILLED_AT - 1.0)}
    assert alive.culprit(records, ended={"master"}) is None


def test_nothing_known_gone_is_no_death():
    assert alive.culprit(live(), ended=set()) is None
    assert alive.culprit(live() | {"trainer1": rec("trainer1", None, 1.0)}, ended=()) is None


# --- the master dies, then a trainer dies of it ---------------------------------------------


def test_the_master_dies_then_a_trainer_dies_of_it():
    # Rank 0's watch found the master gone and its store calls failed: its end record names the
    # master (12.0). Rank 1, starved since 9.0, was then ended by srun (--kill-on-bad-exit) with no
    # end record. The batch script asks about the trainers' step, both ranks gone.
    records = {
        "trainer0": rec("trainer0", alive.FAILED, KILLED_AT + 2.0, cause="master"),
        "trainer1": rec("trainer1", None, KILLED_AT - 1.0),
        "master": rec("master", None, KILLED_AT),
    }
    step = ("trainer0", "trainer1")
    assert alive.culprit(records, ended=step) == "master"
    assert alive.culprit(records, ended=step, missing_died=True) == "master"
    # Without the cause (what rank 0 recorded before), the starved rank's old beat won.
    assert alive.culprit(
        records | {"trainer0": rec("trainer0", alive.FAILED, KILLED_AT + 2.0)}, ended=step
    ) == ("trainer1")
    # A watch of another host, asking about every role, knows the master gone the same way.
    assert alive.culprit(live() | records, ended={"master"}) == "master"
    assert alive.causes(records) == {"master"}


def test_a_named_death_outranks_a_starved_role_that_was_killed_after_it():
    # The master killed at 10.0; trainer rank 1 starved from 8.0 and then SIGKILLed by srun; its
    # peer failed of the master (named). The step's roles all ended, rank 1 first by its beat.
    records = {
        "trainer0": rec("trainer0", alive.FAILED, 12.0, cause="master"),
        "trainer1": rec("trainer1", None, 8.0),
        "master": rec("master", None, KILLED_AT),
    }
    assert alive.culprit(records, ended=("trainer0", "trainer1", "master")) == "master"


def test_a_failure_of_its_own_before_the_named_death_still_wins():
    records = {
        "engine0-0": rec("engine0-0", alive.FAILED, 9.0),
        "trainer0": rec("trainer0", alive.FAILED, 12.0, cause="master"),
        "master": rec("master", None, KILLED_AT),
    }
    assert alive.culprit(records, ended=()) is None


def test_a_cause_that_left_after_all_is_no_death():
    # The watch saw the master's probe refuse, but its record says it left (a SIGTERM it handled):
    # the trainer's failure is then its own, the earliest end.
    records = {
        "trainer0": rec("trainer0", alive.FAILED, 12.0, cause="master"),
        "master": rec("master", "signal 15", KILLED_AT),
    }
    assert alive.culprit(records, ended=("trainer0",)) is None


def test_a_trainer_killed_outright_is_still_named():
    # Rank 1 SIGKILLed at 10.0; rank 0 failed of it (its watch named it); srun ended the rest.
    records = {
        "trainer0": rec("trainer0", alive.FAILED, 11.5, cause="trainer1"),
        "trainer1": rec("trainer1", None, KILLED_AT),
    }
    assert alive.culprit(records, ended=("trainer0", "trainer1")) == "trainer1"
    assert alive.culprit({"master": rec("master", None, 1.0)}, ended=("master",)) == "master"


def test_the_cause_is_written_and_read_back(tmp_path):
    alive.write_record(tmp_path, "trainer0", "trainer rank 0", 0, "host1", 7, alive.FAILED, cause="master")
    got = alive.RoleRecord.read(alive.record_path(tmp_path, "trainer0"))
    assert got is not None and (got.left, got.cause) == (alive.FAILED, "master")
    alive.write_record(tmp_path, "trainer1", "trainer rank 1", 1, "host2", 8, None)
    got = alive.RoleRecord.read(alive.record_path(tmp_path, "trainer1"))
    assert got is not None and got.cause is None


# --- the same through the watch and the batch script, on real files and sockets ---------------


def _ctx(tmp_path: Path, node: int) -> NodeContext:
    cfg = load_recipe(RECIPE, [f"paths.output_dir={tmp_path}"])
    run = RunDir.of(tmp_path, "multihost-j1")
    hosts = ("host1", "host2", "host3", "host4")
    return NodeContext(
        cfg, make_plan(cfg), node, hosts, hosts[node], None, run, HostAddress("lo", "127.0.0.1")
    )


LABELS = {
    "master": ("master", 0),
    "engine0-0": ("engine 0 leader", 2),
    "engine0-1": ("engine 0 follower (node_rank 1)", 3),
    "trainer0": ("trainer rank 0", 0),
    "trainer1": ("trainer rank 1", 1),
}


def _role(ctx: NodeContext, key: str, pid: int, beat: float) -> socket.socket:
    """A role process as its records and probe show it: a real listening socket."""
    label, node = LABELS[key]
    sock = socket.create_server(("127.0.0.1", 0))
    alive.write_record(ctx.run.root, key, label, node, ctx.host(node), pid, None)
    os.utime(alive.record_path(ctx.run.root, key), (beat, beat))
    probe = {"address": "127.0.0.1", "port": sock.getsockname()[1], "key": key}
    write_json_atomic(ctx.run.root / "hosts" / f"n{node}.{pid}.probe", probe)
    return sock


def test_a_watch_names_the_killed_master_while_a_trainer_is_starved(tmp_path):
    ctx = _ctx(tmp_path, 3)  # the engine follower's watch, on host4 (it claimed in issue 44)
    socks = {k: _role(ctx, k, 100 + i, 1000.0 + 2.0) for i, k in enumerate(KEYS) if k != "engine0-1"}
    try:
        os.utime(alive.record_path(ctx.run.root, "master"), (1000.0, 1000.0))
        # Trainer rank 1 starved since 999.0: its probe still accepts (the kernel does), its beat
        # is older than the master's last.
        os.utime(alive.record_path(ctx.run.root, "trainer1"), (999.0, 999.0))
        socks.pop("master").close()  # SIGKILL: the kernel closes its socket, its records stay
        watch = PeerWatch(ctx)
        reasons = [watch._check(0) for _ in range(DEAD_ROUNDS)]
        assert reasons[-1] is not None and reasons[-1].startswith(
            "stopping: master (node host1) is dead (its process 100 is gone, no end record; nothing listens on"
        )
        assert watch._check(1) is None  # trainer rank 1 answers: live
        assert json.loads(alive.died_path(ctx.run.root).read_text())["key"] == "master"
        assert watch.cause == "master"
        # Another host's watch then finds the claim, and names the same cause for its end record.
        other = PeerWatch(_ctx(tmp_path, 1))
        last = [other._check(0) for _ in range(DEAD_ROUNDS)][-1]
        assert last is not None and "names it" in last and other.cause == "master"
    finally:
        for s in socks.values():
            s.close()


def test_the_batch_script_names_the_master_a_trainer_failed_of(tmp_path, monkeypatch, capsys):
    # The trainers' step ended first (rank 0 failed of the master's death, rank 1 was ended by srun
    # with an old beat) and no watch's claim reached the run directory: the batch script names
    # the master from rank 0's end record.
    from hpctoolkit.roles.verdict import run_died

    ctx = _ctx(tmp_path, 0)
    root = ctx.run.root
    alive.write_record(root, "master", "master", 0, "host1", 5, None)
    alive.write_record(root, "trainer0", "trainer rank 0", 0, "host1", 6, alive.FAILED, cause="master")
    alive.write_record(root, "trainer1", "trainer rank 1", 1, "host2", 7, None)
    for key, beat in (("trainer1", 999.0), ("master", 1000.0), ("trainer0", 1002.0)):
        os.utime(alive.record_path(root, key), (beat, beat))
    monkeypatch.setenv("HPCTOOLKIT_FAILED_STEP", "trainer")
    monkeypatch.setenv("HPCTOOLKIT_FAILED_STATUS", "1")
    assert run_died(ctx) == 0
    said = [x for x in capsys.readouterr().out.splitlines() if " died (" in x]
    assert said == ["hpctoolkit: master (node host1) died (its process 5 is gone, no end record)"]
    claim = alive.claimed(root)
    assert claim is not None and claim["by"] == "the batch script"
