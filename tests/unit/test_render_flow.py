"""The rendered batch script's control flow, run by bash with fake `srun`/`scontrol` and a fake
interpreter (no Slurm): every role starts once, SIGUSR2 on the batch shell reaches the trainers, the
script exits with the trainers' status and ends the services (after a clean run the engines leave
by themselves and the master is ended last), a service step that dies ends the run at once and its
role is named (`roles died`), a trainers' step that fails has its dead rank named, evaluate runs after the engines left and before the
master is ended (`plan.lifecycle`'s order) and only after a clean run, and a failed check starts
nothing."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest

from hpctoolkit.plan.placement import make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.slurm.render import render_sbatch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "tests/golden/emulated_3node.yaml"

FAKE_SRUN = """#!/bin/bash
# Drop srun's options, log where the step was pinned, become the step's command.
nodelist=""
while [[ $1 == --* ]]; do
  [[ $1 == --nodelist=* ]] && nodelist=${1#--nodelist=}
  shift
done
echo "$nodelist $*" >> "$FLOW_DIR/steps"
exec "$@"
"""
FAKE_SCONTROL = """#!/bin/bash
if [[ $1 == requeue ]]; then echo "$*" >> "$FLOW_DIR/requeued"; exit 0; fi
printf 'node1\\nnode2\\nnode3\\n'
"""
# Stands in for `python3 -m hpctoolkit.roles ROLE RECIPE ...`.
FAKE_PYTHON = """#!/bin/bash
role=$3
case $role in
  check) [[ ${FLOW_CHECK_FAILS:-0} == 1 ]] && { echo "error: re-render" >&2; exit 2; }; exit 0 ;;
  preempted) echo preempted >> "$FLOW_DIR/asked"; exit "${FLOW_PREEMPTED_RC:-1}" ;;
  died) echo "$HPCTOOLKIT_FAILED_STEP $HPCTOOLKIT_FAILED_STATUS" >> "$FLOW_DIR/died"; exit 0 ;;
  evaluate)
    # The engines have ended by now (drain); the master is ended after (stop).
    [[ -e $FLOW_DIR/left || ! -e $FLOW_DIR/drained ]] || exit 97
    [[ ! -e $FLOW_DIR/terminated ]] || exit 96
    echo evaluate >> "$FLOW_DIR/evaluated"
    exit "${FLOW_EVALUATE_RC:-0}" ;;
  trainer)
    trap 'echo usr2 >> "$FLOW_DIR/trainer-usr2"; exit "${FLOW_TRAINER_RC:-0}"' USR2
    touch "$FLOW_DIR/trainer-up"
    if [[ ${FLOW_TRAINER_FINISHES:-0} == 1 ]]; then sleep 0.5; touch "$FLOW_DIR/drained"; exit 0; fi
    for _ in $(seq 1 300); do sleep 0.1; done
    exit 99 ;;
  *)
    trap 'echo "$role" >> "$FLOW_DIR/terminated"; exit 0' TERM
    # A role killed outright: srun's status for a task ended by SIGKILL.
    if [[ $role == "${FLOW_DIES:-}" ]]; then sleep 1; exit 137; fi
    for _ in $(seq 1 300); do
      # Engines leave by themselves once drained, a little after the trainers (as the real ones).
      if [[ $role == engine-* && -e $FLOW_DIR/drained ]]; then
        sleep 1; echo "$role" >> "$FLOW_DIR/left"; exit 0
      fi
      sleep 0.1
    done
    exit 98 ;;
esac
"""


@pytest.fixture
def flow(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("fakepython", FAKE_PYTHON)):
        exe = bin_dir / name
        exe.write_text(body)
        exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    ov = [f"paths.output_dir={tmp_path}"]
    cfg = load_recipe(RECIPE, ov)
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(cfg, make_plan(cfg), recipe_path=RECIPE, overrides=ov))
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FLOW_DIR": str(tmp_path),
        "HPCTOOLKIT_PYTHON": str(bin_dir / "fakepython"),
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_JOB_ID": "42",
    }
    return tmp_path, script, env


def _wait_for(path: Path, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("trainer_rc", "preempted_rc", "want_rc"),
    [(0, 1, 0), (3, 1, 3), (75, 1, 0), (143, 0, 0), (143, 1, 143)],
)
def test_usr2_reaches_trainers_and_status_propagates(flow, trainer_rc, preempted_rc, want_rc):
    """75 requeues; so does another status (a rank ended by the first rank's exit 75) when the
    run's records say the checkpoint is complete (`roles preempted` exits 0), else it propagates."""
    tmp, script, env = flow
    env["FLOW_TRAINER_RC"] = str(trainer_rc)
    env["FLOW_PREEMPTED_RC"] = str(preempted_rc)
    proc = subprocess.Popen(
        ["bash", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for(tmp / "trainer-up")
        time.sleep(0.3)  # let every step start
        proc.send_signal(signal.SIGUSR2)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == want_rc, out
    asked = trainer_rc not in (0, 75)
    assert (tmp / "asked").exists() == asked, out
    # A failure that is no preemption: the rank that died, if one did, is named.
    died = asked and preempted_rc != 0
    assert (tmp / "died").exists() == died, out
    if died:
        assert (tmp / "died").read_text() == f"trainer {trainer_rc}\n"
    assert (tmp / "requeued").exists() == (trainer_rc == 75 or (asked and preempted_rc == 0)), out
    assert (tmp / "trainer-usr2").read_text() == "usr2\n"
    assert "SIGUSR2: asking the trainers to checkpoint" in out
    assert f"trainers exited with status {trainer_rc}" in out
    steps = (tmp / "steps").read_text().splitlines()
    pinned = sorted((line.split()[0], line.split()[4]) for line in steps if " preempted " not in line)
    assert pinned == [
        ("node1", "master"),
        ("node1", "trainer"),
        ("node2", "engine-leader"),
        ("node3", "engine-follower"),
    ]
    assert all(f" {RECIPE} paths.output_dir={tmp}" in line for line in steps)
    assert sorted((tmp / "terminated").read_text().split()) == ["engine-follower", "engine-leader", "master"]
    # The time limit is near (or the trainers failed): no evaluate step.
    assert not (tmp / "evaluated").exists()
    if trainer_rc == 0:
        assert "evaluate skipped: the time limit is near" in out


@pytest.mark.parametrize("evaluate_rc", [0, 4])
def test_after_a_clean_run_engines_leave_by_themselves_then_evaluate_the_master_last(flow, evaluate_rc):
    tmp, script, env = flow
    env["FLOW_TRAINER_FINISHES"] = "1"
    env["FLOW_EVALUATE_RC"] = str(evaluate_rc)
    out = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == evaluate_rc, out.stdout + out.stderr
    assert sorted((tmp / "left").read_text().split()) == ["engine-follower", "engine-leader"]
    assert (tmp / "terminated").read_text().split() == ["master"]
    assert (tmp / "evaluated").read_text().split() == ["evaluate"]
    last = (tmp / "steps").read_text().splitlines()[-1].split()
    assert (last[0], last[4]) == ("node1", "evaluate")  # trainer rank 0's node
    assert f"evaluate exited with status {evaluate_rc}" in out.stdout


def test_no_evaluate_step_when_disabled(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    ov = [f"paths.output_dir={tmp_path}", "evaluate.enabled=false"]
    cfg = load_recipe(RECIPE, ov)
    text = render_sbatch(cfg, make_plan(cfg), recipe_path=RECIPE, overrides=ov)
    assert "--job-name=evaluate" not in text and "roles evaluate" not in text
    assert text.endswith('exit "$rc"\n')


def test_failed_check_starts_no_step(flow):
    tmp, script, env = flow
    env["FLOW_CHECK_FAILS"] = "1"
    out = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    assert out.returncode == 2
    assert "re-render" in out.stderr
    assert not (tmp / "steps").exists()


@pytest.mark.parametrize(
    ("role", "step"), [("master", "master"), ("engine-leader", "engine0-0"), ("engine-follower", "engine0-1")]
)
def test_a_service_that_dies_ends_the_run_naming_it(flow, role, step):
    """The lifecycle's watch: a service step that exits non-zero before the trainers end ends the
    trainers at once and every other step, the run fails (exit 1), and `roles died` is asked
    once, for that step and its status."""
    tmp, script, env = flow
    env["FLOW_DIES"] = role
    t0 = time.monotonic()
    out = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=30, check=False
    )
    took = time.monotonic() - t0
    assert out.returncode == 1, out.stdout + out.stderr
    assert (tmp / "died").read_text() == f"{step} 137\n"
    assert f"step {step} exited with status 137 before the trainers ended; ending the run" in out.stderr
    # The trainers were ended (no checkpoint asked of them), and every other service step.
    assert not (tmp / "trainer-usr2").exists()
    others = sorted({"master", "engine-leader", "engine-follower"} - {role})
    assert sorted((tmp / "terminated").read_text().split()) == others
    assert not (tmp / "evaluated").exists()
    assert took < 15, took
