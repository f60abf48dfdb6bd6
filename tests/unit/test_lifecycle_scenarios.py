"""The three backends against the one lifecycle (`plan.lifecycle`): the embedded launcher
(`roles.local.run_local`), the rendered batch script (run by bash with fake `srun`/`scontrol`) and
submitit's tasks (`roles.dispatch.follow`, in-process) walk the same scenarios with stub roles and
must enter the same phases, start and end the same roles and reach the same outcome as
`lifecycle.walk` says: a normal end, a failed trainer, SIGUSR2 (the trainers checkpoint, evaluate
is skipped, the job requeues) and a failed evaluate. No vLLM, no store, no torch: seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hpctoolkit import envs
from hpctoolkit.errors import ConfigError, RoleFailedError
from hpctoolkit.plan import lifecycle as lc
from hpctoolkit.plan.placement import make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.rundir.layout import RunDir
from hpctoolkit.rundir.ledger import PREEMPTED_EXIT
from hpctoolkit.slurm.render import render_sbatch

ROOT = Path(__file__).resolve().parents[2]
SLURM_RECIPE = "tests/golden/emulated_3node.yaml"
LOCAL_RECIPE = "recipes/tiny.yaml"

# name -> (trainers' status, SIGUSR2 while they train, evaluate's status)
SCENARIOS = {
    "normal": (0, False, 0),
    "failed-trainer": (3, False, 0),
    "usr2": (PREEMPTED_EXIT, True, 0),
    "failed-evaluate": (0, False, 4),
}
SHAPE = lc.RunShape(own_master=True, evaluate=True)

# Stands in for `python -m hpctoolkit.roles ROLE RECIPE ...` (the batch script's interpreter and the
# embedded launcher's role command): records `start ROLE` / `end ROLE` in $SCN_DIR/trace.
STUB_ROLE = """#!/bin/bash
role=$3
note() { echo "$1 $role" >> "$SCN_DIR/trace"; }
case $role in
  check) exit 0 ;;
  preempted) exit 1 ;;
  died) exit 1 ;;
esac
note start
case $role in
  master)
    trap 'note end; exit 0' TERM
    if [[ -n ${HPCTOOLKIT_RUN_ID:-} ]]; then
      run=$SCN_OUT/$HPCTOOLKIT_RUN_ID
      echo '{"address": "stub:1"}' > "$run/.master.tmp" && mv "$run/.master.tmp" "$run/master.json"
    fi
    while :; do sleep 0.05; done ;;
  engine-*)
    trap 'note end; exit 0' TERM
    # Engines leave by themselves once the trainers drained them.
    while [[ ! -e $SCN_DIR/drained ]]; do sleep 0.05; done
    note end; exit 0 ;;
  trainer)
    if [[ $SCN_USR2 == 1 ]]; then
      trap 'note end; exit 75' USR2
      touch "$SCN_DIR/trainer-up"
      for _ in $(seq 1 600); do sleep 0.05; done
      exit 99
    fi
    sleep 0.2
    [[ $SCN_TRAINER_RC != 0 ]] || touch "$SCN_DIR/drained"
    note end; exit "$SCN_TRAINER_RC" ;;
  evaluate) note end; exit "$SCN_EVALUATE_RC" ;;
esac
exit 98
"""
FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ $1 == requeue ]]; then touch "$SCN_DIR/requeued"; exit 0; fi
printf 'node1\\nnode2\\nnode3\\n'
"""


@dataclasses.dataclass
class Walked:
    phases: list[str]
    started: list[str]
    ended: list[str]
    kind: str
    failed: str | None


def _expected(name: str) -> tuple[tuple[str, ...], lc.Outcome]:
    trainer_rc, usr2, evaluate_rc = SCENARIOS[name]
    return lc.walk(SHAPE, lc.Seen(trainers_rc=trainer_rc, late=usr2), evaluate_rc)


def _trace(scn: Path) -> tuple[list[str], list[str]]:
    lines = [x.split() for x in (scn / "trace").read_text().splitlines()] if (scn / "trace").exists() else []
    return [r for k, r in lines if k == "start"], [r for k, r in lines if k == "end"]


def _bin(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("stubrole", STUB_ROLE)):
        exe = bin_dir / name
        exe.write_text(body)
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _env(scn: Path, out: Path, name: str) -> dict[str, str]:
    trainer_rc, usr2, evaluate_rc = SCENARIOS[name]
    return {
        "SCN_DIR": str(scn),
        "SCN_OUT": str(out),
        "SCN_TRAINER_RC": str(trainer_rc),
        "SCN_USR2": "1" if usr2 else "0",
        "SCN_EVALUATE_RC": str(evaluate_rc),
    }


def _send_usr2_when_up(scn: Path, pid: int) -> threading.Thread:
    def send() -> None:
        deadline = time.monotonic() + 30
        while not (scn / "trainer-up").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.2)
        os.kill(pid, signal.SIGUSR2)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    return t


def walk_batch(tmp: Path, name: str) -> Walked:
    out, scn = tmp / "out", tmp / "scn"
    scn.mkdir()
    ov = [f"paths.output_dir={out}"]
    cfg = load_recipe(SLURM_RECIPE, ov)
    script = tmp / "job.sbatch"
    script.write_text(render_sbatch(cfg, make_plan(cfg), recipe_path=SLURM_RECIPE, overrides=ov))
    bin_dir = _bin(tmp)
    env = {
        **os.environ,
        **_env(scn, out, name),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HPCTOOLKIT_PYTHON": str(bin_dir / "stubrole"),
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_JOB_ID": "42",
    }
    proc = subprocess.Popen(
        ["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    if SCENARIOS[name][1]:
        _send_usr2_when_up(scn, proc.pid)
    stdout, _ = proc.communicate(timeout=60)
    phases = [x.split()[-1] for x in stdout.splitlines() if x.startswith("[hpctoolkit] phase ")]
    started, ended = _trace(scn)
    if (scn / "requeued").exists():
        kind, failed = lc.PREEMPTED, None
    elif proc.returncode == 0:
        kind, failed = lc.OK, None
    else:
        kind, failed = lc.FAILED, ("evaluate" if "evaluate" in started else "trainers")
    assert proc.returncode == _expected(name)[1].code, stdout
    return Walked(phases, started, ended, kind, failed)


def walk_local(tmp: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> Walked:
    from hpctoolkit.roles.local import run_local

    out, scn = tmp / "out", tmp / "scn"
    scn.mkdir()
    bin_dir = _bin(tmp)
    for k, v in _env(scn, out, name).items():
        monkeypatch.setenv(k, v)
    ov = [f"paths.output_dir={out}"]
    cfg = load_recipe(LOCAL_RECIPE, ov)
    phases: list[str] = []
    if SCENARIOS[name][1]:
        _send_usr2_when_up(scn, os.getpid())
    kind, failed = lc.OK, None
    try:
        run_local(
            cfg,
            make_plan(cfg),
            LOCAL_RECIPE,
            ov,
            role_argv=lambda role: [str(bin_dir / "stubrole"), "-m", "hpctoolkit.roles", role],
            on_phase=phases.append,
        )
    except RoleFailedError as err:
        if "SIGUSR2" in str(err):
            kind = lc.PREEMPTED
        else:
            # The one line names the role process: trainer<r> or evaluate.
            role = str(err).split()[0].rstrip("0123456789")
            kind, failed = lc.FAILED, {"trainer": "trainers"}.get(role, role)
    started, ended = _trace(scn)
    return Walked(phases, started, ended, kind, failed)


def walk_submitit(tmp: Path, name: str, monkeypatch: pytest.MonkeyPatch) -> Walked:
    from hpctoolkit.roles import dispatch
    from hpctoolkit.roles.context import load_context
    from hpctoolkit.slurm.env import SlurmEnvironment
    from hpctoolkit.slurm.tasks import task_process, tasks_per_node
    from hpctoolkit.train import preempt

    trainer_rc, usr2, evaluate_rc = SCENARIOS[name]
    out = tmp / "out"
    ov = [f"paths.output_dir={out}"]
    plan = make_plan(load_recipe(SLURM_RECIPE, ov))
    started: list[str] = []
    ended: list[str] = []

    def stub(role: str):
        def run(ctx, proc) -> int:
            started.append(role)
            code = 0
            if role.startswith("engine") and proc.node_rank == 0:
                ctx.run.engine_closed(proc.engine).parent.mkdir(parents=True, exist_ok=True)
                ctx.run.engine_closed(proc.engine).write_text("{}")
            if role == "trainer":
                if usr2:
                    preempt.request()  # what the trainer's SIGUSR2 handler does
                code = trainer_rc
            ended.append(role)
            return code

        return run

    class StubChild:
        def __init__(self, role, *_args):
            started.append(role)

        def result(self) -> int:
            ended.append("evaluate")
            return evaluate_rc

    monkeypatch.setattr(dispatch, "ROLE_FUNCS", {r: stub(r) for r in dispatch.ROLE_FUNCS})
    monkeypatch.setattr(dispatch, "Child", StubChild)
    monkeypatch.setattr(dispatch, "run_watcher", lambda ctx: 0)
    # Every task of the job, (ctx, senv, process); run one after the other in phase order (task 0,
    # the master's, first: it starts the attempt), as the real ones meet through the run directory.
    jobs = []
    proc_id = 0
    for node in range(plan.num_nodes):
        environ = {
            "SLURM_JOB_ID": "42",
            "SLURM_JOB_NODELIST": "node[1-3]",
            "SLURMD_NODENAME": f"node{node + 1}",
            "SLURM_NODEID": str(node),
            envs.HPCTOOLKIT_PLAN_DIGEST.name: plan.digest(),
        }
        # One node's context; without `slurm` the role runs unwatched (no peer probes).
        ctx = dataclasses.replace(load_context(SLURM_RECIPE, ov, environ), slurm=None)
        for local_id in range(tasks_per_node(plan)):
            proc = task_process(plan, node, local_id)
            env = {**environ, "SLURM_PROCID": str(proc_id), "SLURM_LOCALID": str(local_id)}
            proc_id += 1
            if proc is not None:
                jobs.append((ctx, SlurmEnvironment.from_env(env), proc))
    order = {n: i for i, n in enumerate(lc.PHASE_NAMES)}
    jobs.sort(key=lambda j: order[dispatch.PHASE_OF_ROLE.get(getattr(j[2], "role", ""), "master")])
    tasks: list[list[str]] = []
    rank0 = None
    try:
        for ctx, senv, proc in jobs:
            phases: list[str] = []
            code = dispatch.follow(ctx, senv, proc, SLURM_RECIPE, ov, on_phase=phases.append)
            tasks.append(phases)
            if getattr(proc, "role", None) == "trainer" and proc.node_rank == 0:
                rank0 = (code, "evaluate" in phases)
    finally:
        preempt.reset()
    # Each task follows the phases in their order; together they enter the run's.
    assert all(t == sorted(t, key=order.__getitem__) for t in tasks), tasks
    entered = sorted({n for t in tasks for n in t}, key=order.__getitem__)
    # The end: the trainers' end records, submitit's requeue on task 0 (neither is a task's phase).
    entered.append("end")
    assert rank0 is not None
    code, evaluated = rank0
    if code == PREEMPTED_EXIT:
        kind, failed = lc.PREEMPTED, None
    elif code == 0:
        kind, failed = lc.OK, None
    else:
        kind, failed = lc.FAILED, ("evaluate" if evaluated else "trainers")
    return Walked(entered, started, ended, kind, failed)


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("backend", ["local", "batch", "submitit"])
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_every_backend_walks_the_lifecycle(tmp_path, monkeypatch, backend, name):
    if backend == "local":
        got = walk_local(tmp_path, name, monkeypatch)
    elif backend == "batch":
        got = walk_batch(tmp_path, name)
    else:
        got = walk_submitit(tmp_path, name, monkeypatch)
    names, outcome = _expected(name)
    assert got.phases == list(names), got
    assert (got.kind, got.failed) == (outcome.kind, outcome.failed), got
    # The roles the phases start, each kind once at least (a local plan has no follower node).
    kinds = sorted(set(got.started))
    want = sorted(set(lc.roles_started(names)) - ({"engine-follower"} if backend == "local" else set()))
    assert kinds == want, got
    # Every role started also ended: nothing is left running.
    assert sorted(got.started) == sorted(got.ended), got


def test_a_role_s_failure_record_keeps_its_class_and_its_one_line(tmp_path, monkeypatch):
    """`run_cli` writes the record the launcher reads: a config error stays one (exit 2)."""
    from hpctoolkit.cli import run_cli
    from hpctoolkit.roles.local import RoleProcess

    record = tmp_path / "logs" / "trainer0.failure.json"
    record.parent.mkdir()
    monkeypatch.setenv(envs.HPCTOOLKIT_FAILURE_RECORD.name, str(record))

    def main(_argv: list[str]) -> int:
        raise ConfigError("training.steps: must be positive")

    with pytest.raises(SystemExit) as exited:
        run_cli(main, [])
    assert exited.value.code == 2
    assert envs.HPCTOOLKIT_FAILURE_RECORD.name not in os.environ  # not for its children
    assert json.loads(record.read_text()) == {
        "error": "ConfigError",
        "message": "training.steps: must be positive",
        "said": "training.steps: must be positive",
    }
    run = RunDir.of(tmp_path, "r")
    p = RoleProcess("trainer0", ["bash", "-c", "exit 2"], dict(os.environ), run.log("trainer0"), record)
    p.proc.wait()
    err = p.failure()
    p.stop()
    assert isinstance(err, ConfigError)
    assert str(err) == f"trainer0: training.steps: must be positive (exit code 2; log {run.log('trainer0')})"
    # Without a record (killed, or no run_cli): the log's last line, as a failed role.
    record.unlink()
    assert str(p.failure()).startswith("trainer0 failed: no output (exit code 2;")
