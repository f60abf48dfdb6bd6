"""A role killed outright ends the job: each role of a job on the emulated hosts in turn (the
master, the engine's leader and its headless follower, each trainer rank) gets SIGKILL, as the OOM
killer would send it, and writes no end record. The job must end within `DEATH_BOUND_S`
(`plan.lifecycle`), Slurm recording it FAILED, its output holding exactly one line that says the
role died, naming it, and no process of ours (a role, vLLM's workers, the Mooncake master) left on
any host.

Layout (tests/recipes/multihost.yaml, as tests/e2e/test_multihost.py): host1 the master and trainer
rank 0, host2 trainer rank 1, host3 the engine's leader, host4 its follower. The pid to kill comes
from the role's own record in the run directory (`rundir.alive`). One cluster serves every case.

A last case kills the master while trainer rank 1 is stopped (SIGSTOP, standing in for a process
starved on a loaded host): the run must still name the master (issue 44), whoever claims the death
first (a peer's watch or the batch script).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import job_processes, wait_done
from test_multihost import NODES, hosts, log_of, ours, role_processes, sbatch  # noqa: F401 - hosts: fixture

from hpctoolkit.plan.lifecycle import DEATH_BOUND_S
from hpctoolkit.rundir import alive

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(900)]

# How long a role may take to come up (its record written; an engine: capturing).
UP_TIMEOUT_S = 300
# The batch script's last phase line: the job ended without the role coming up.
ENDED = "[hpctoolkit] phase end"
# A stalled role (SIGSTOP, as starvation) stops beating this long before the kill, and resumes
# this long after it: longer than the peers' watches take to find the victim gone.
STALL_BEFORE_S = 1.5
STALL_AFTER_S = 6.0
KEYS = ("master", "engine0-0", "engine0-1", "trainer0", "trainer1")
# Our processes, by what their command line holds.
OURS = re.compile(r"hpctoolkit|vllm|mooncake|VLLM", re.IGNORECASE)


def left_on_hosts() -> list[str]:
    """Processes of ours still running in any host's network namespace (slurmd is the host's)."""
    left = []
    for i in range(1, NODES + 1):
        pids = subprocess.run(
            ["ip", "netns", "pids", f"hpct-n{i}"], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in pids:
            try:
                raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            cmd = raw.replace(b"\0", b" ").decode(errors="replace")
            if OURS.search(cmd) and "slurmd" not in cmd:
                left.append(f"host{i} {pid} {cmd[:160]}")
    return left


def _wait_up(job: str, out, run, key: str) -> alive.RoleRecord:
    """Every role's record is there (an engine role: the engine captures); `key`'s record."""
    deadline = time.monotonic() + UP_TIMEOUT_S
    while time.monotonic() < deadline:
        records = alive.read_records(run.root, KEYS)
        up = all(r is not None and r.left is None for r in records.values())
        if key.startswith("engine"):
            q = run.queue(0)
            up = up and q.exists() and q.read_text().count("\n") >= 1
        if up:
            rec = records[key]
            assert rec is not None
            return rec
        if run.ended.exists() or any(run.manifests.glob("*.failed")) or ENDED in log_of(out, job):
            pytest.fail(f"job {job} ended before the kill:\n{ours(log_of(out, job))}")
        time.sleep(0.5)
    pytest.fail(f"job {job}: {key} never came up:\n{ours(log_of(out, job))[-4000:]}")


@pytest.mark.parametrize(
    ("key", "label"),
    [
        ("master", "master"),
        ("engine0-0", "engine 0 leader"),
        ("engine0-1", "engine 0 follower (node_rank 1)"),
        ("trainer0", "trainer rank 0"),
        ("trainer1", "trainer rank 1"),
    ],
    ids=["master", "engine-leader", "engine-follower", "trainer-rank0", "trainer-rank1"],
)
def test_a_killed_role_ends_the_job_naming_it(hosts, tmp_path, key, label):  # noqa: F811 - the fixture
    _kill_and_check(hosts, tmp_path, key, label)


def test_a_killed_master_is_named_while_a_trainer_is_starved(hosts, tmp_path):  # noqa: F811 - the fixture
    """The 2-core AVX2 machine (issue 44): a trainer rank starved of the CPU (a long C call that
    holds the GIL, as loading a shared library does under load) stops beating a while before the
    master is killed. A watch that then finds the master gone must name it, not the live trainer
    whose last beat is older. SIGSTOP stands in for the starvation, deterministically."""
    _kill_and_check(hosts, tmp_path, "master", "master", stall="trainer1")


def _kill_and_check(hosts, tmp_path, key: str, label: str, stall: str | None = None) -> None:  # noqa: F811 - the fixture
    out = tmp_path / "out"
    # Longer than the kill takes to come: the job must end because of it, not by finishing.
    job, run = sbatch(hosts, out, "data.num_samples=96", "engine.capture_batch=2", "training.steps=400")
    t0 = time.monotonic()
    rec = _wait_up(job, out, run, key)
    up_after = time.monotonic() - t0
    stalled = _records(run)[stall] if stall else None
    try:
        if stalled is not None:
            os.kill(stalled.pid, signal.SIGSTOP)
            time.sleep(STALL_BEFORE_S)  # its last beat is now older than the victim's will be
        os.kill(rec.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        if stalled is not None:
            time.sleep(STALL_AFTER_S)  # the peers' watches find the victim gone meanwhile
    finally:
        if stalled is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(stalled.pid, signal.SIGCONT)
    while role_processes(job) and time.monotonic() - t_kill < DEATH_BOUND_S:
        time.sleep(0.5)
    roles_gone = time.monotonic() - t_kill
    state = wait_done(job, hosts, max(1.0, DEATH_BOUND_S - roles_gone), log=out / f"slurm-{job}.out")
    ended = time.monotonic() - t_kill
    log = log_of(out, job)
    died = [x for x in log.splitlines() if " died (" in x]
    claim = alive.claimed(run.root)
    print(
        f"\n[measure] {label} (pid {rec.pid} on {rec.host}) killed {up_after:.1f}s after submission"
        f"{f' ({stall} stalled)' if stall else ''}: roles gone {roles_gone:.1f}s, Slurm {state} "
        f"{ended:.1f}s after the kill; claimed by {claim and claim.get('by')}\n{ours(log)[-3000:]}"
    )
    assert state == "FAILED", log[-6000:]
    assert ended < DEATH_BOUND_S
    assert len(died) == 1, ours(log)[-4000:]
    assert f"{label} (node {rec.host}) died (" in died[0], (died, _records(run))
    assert len(died[0]) < 400 and "Traceback" not in ours(log)
    # What the roles started ends with them (their guards' SIGKILL), a moment after on a loaded
    # host: within the same bound, none is left.
    deadline = t_kill + DEATH_BOUND_S
    while (job_processes(job) or left_on_hosts()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not job_processes(job), job_processes(job)
    assert not left_on_hosts(), left_on_hosts()


def _records(run) -> dict[str, alive.RoleRecord | None]:
    return alive.read_records(run.root, KEYS)
