"""Real Slurm: the emulated 8-node cluster of launch/local_slurm.sh runs a rendered batch script
and a submitit job with `HPCTOOLKIT_NODE_DRY=1`, and every role must land on the node and GPUs the
plan gave it. Needs root and Debian's slurm-wlm/slurmdbd/munge/mariadb (launch/system_deps.sh).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import wait_done

from hpctoolkit.plan.placement import ROLE_TRAINER, Plan, make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.slurm import shell
from hpctoolkit.slurm.env import expand_hostlist
from hpctoolkit.slurm.handoff import submit_sbatch, submit_submitit
from hpctoolkit.slurm.render import render_sbatch

ROOT = Path(__file__).resolve().parents[2]
SLURM_NODES = 8

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(240)]


def parse_lines(lines: list[str]) -> list[dict[str, str]]:
    return [dict(f.split("=", 1) for f in line.split()) for line in lines if line.startswith("role=")]


def _key(role: str, host: str, engine: str, node_rank: str, rank: str) -> tuple[str, ...]:
    return (role, host, engine, rank if role == ROLE_TRAINER else node_rank)


def check_placement(plan: Plan, hosts: tuple[str, ...], landed: list[dict[str, str]]) -> None:
    """Each planned process printed exactly once, from its planned node, seeing its planned GPUs."""
    want = sorted(
        _key(
            p.role,
            hosts[p.node],
            "-" if p.engine is None else str(p.engine),
            "-" if p.node_rank is None else str(p.node_rank),
            str(p.node_rank),
        )
        for p in plan.processes()
    )
    got = sorted(_key(d["role"], d["node"], d["engine"], d["node_rank"], d.get("rank", "")) for d in landed)
    assert got == want
    for d in landed:
        seen = d["gpus"].split(",")
        if d["role"].startswith("engine"):
            # An engine node's step gets exactly its GPUs.
            assert d["gpus"] == d["planned_gpus"], d
        elif d["role"] == ROLE_TRAINER:
            # Every rank of a node sees the node's trainer GPUs and takes the one at its local rank.
            assert len(seen) == plan.trainer.ranks_per_node, d
            assert seen[int(d["local_rank"])] == d["planned_gpus"], d


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """Submit all three jobs at once (the cluster has room); each test then waits for its own."""
    recipe = "tests/golden/emulated_3node.yaml"
    out = tmp_path_factory.mktemp("run")
    overrides = [f"paths.output_dir={out}"]
    cfg = load_recipe(ROOT / recipe, overrides)
    plan = make_plan(cfg)
    text = render_sbatch(cfg, plan, recipe_path=recipe, overrides=overrides)
    env = {**slurm_cluster, "HPCTOOLKIT_NODE_DRY": "1", "HPCTOOLKIT_PYTHON": sys.executable}
    t0 = time.monotonic()
    # The Mooncake master runs for real; the GPU roles are dry and first dial it from their nodes.
    placed_env = {**env, "HPCTOOLKIT_NODE_DRY": "engine-leader,engine-follower,trainer"}
    placed = submit_sbatch(text, ROOT, env=placed_env)
    # A placement-changing argument at submission time no longer matches the rendered digest.
    stale = submit_sbatch(text, ROOT, args=["training.world_size=2"], env=env)
    small = "tests/golden/small_2node.yaml"
    small_cfg = load_recipe(ROOT / small)
    small_plan = make_plan(small_cfg)
    folder = tmp_path_factory.mktemp("submitit")
    cwd = os.getcwd()
    os.chdir(ROOT)  # the job runs where it was submitted; recipes name files relative to the repo
    try:
        sub = submit_submitit(small_cfg, small_plan, recipe_path=small, folder=folder, dry=True)
    finally:
        os.chdir(cwd)
    return {
        "env": env,
        "t0": t0,
        "out": out,
        "placed": (placed, plan),
        "stale": stale,
        "submitit": (sub, small_plan),
    }


def test_rendered_batch_script_places_every_role(jobs):
    env, out = jobs["env"], jobs["out"]
    job, plan = jobs["placed"]
    state = wait_done(job, env)
    log = (out / f"slurm-{job}.out").read_text()
    print(f"sbatch job {job}: {state} {time.monotonic() - jobs['t0']:.1f}s after submission\n{log}")
    assert state == "COMPLETED", log
    hosts_line = re.search(r"^hosts=(\S+)$", log, re.M)
    assert hosts_line, log
    hosts = tuple(hosts_line.group(1).split(","))
    alloc = shell.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "NodeList"], env=env).strip()
    assert hosts == expand_hostlist(alloc)  # the script's host order is the allocation's
    assert len(set(hosts)) == plan.num_nodes
    assert f"plan {plan.digest()} matches" in log
    master_line = re.search(r"^\[hpctoolkit.master\] Mooncake master at (\S+) on (\S+)$", log, re.M)
    assert master_line and master_line.group(2) == hosts[0], log
    address = master_line.group(1)
    landed = parse_lines(log.splitlines())
    # Every dry role reached the real master at the planned address (node 0's host, port 50051).
    assert {d["store"] for d in landed} == {address}
    landed.append(
        {"role": "master", "node": master_line.group(2), "engine": "-", "node_rank": "-", "gpus": ""}
    )
    check_placement(plan, hosts, landed)
    assert "trainers exited with status 0" in log
    steps = shell.run(["sacct", "-n", "-P", "-j", job, "-o", "JobName,NodeList,State"], env=env)
    by_name = {line.split("|")[0]: line.split("|")[1:] for line in steps.splitlines()}
    assert by_name["engine0-0"] == [hosts[1], "COMPLETED"]
    assert by_name["engine0-1"] == [hosts[2], "COMPLETED"]
    assert by_name["trainer"] == [hosts[0], "COMPLETED"]
    assert by_name["master"][0] == hosts[0]


def test_stale_script_fails_before_any_step(jobs):
    env, out, job = jobs["env"], jobs["out"], jobs["stale"]
    assert wait_done(job, env) == "FAILED"
    log = (out / f"slurm-{job}.out").read_text()
    print(f"stale job {job}: failed {time.monotonic() - jobs['t0']:.1f}s after submission")
    assert "re-render" in log and "role=" not in log
    steps = shell.run(["sacct", "-n", "-P", "-j", job, "-o", "JobName"], env=env).split()
    assert "trainer" not in steps and "master" not in steps


def test_submitit_job_places_every_role(jobs, slurm_cluster):
    job, plan = jobs["submitit"]
    results = job.results()
    print(
        f"submitit job {job.job_id}: {len(results)} tasks, {time.monotonic() - jobs['t0']:.1f}s after submission"
    )
    assert len(results) == plan.num_nodes * plan.max_processes_per_node()
    lines = [r for r in results if r is not None]
    assert len(lines) == len(plan.processes())
    alloc = shell.run(["sacct", "-X", "-n", "-P", "-j", str(job.job_id), "-o", "NodeList"], env=slurm_cluster)
    hosts = expand_hostlist(alloc.strip())
    landed = parse_lines(lines)
    assert {d["node"] for d in landed} == set(hosts)
    want = sorted((p.role, hosts[p.node], str(p.node_rank)) for p in plan.processes())
    got = sorted(
        (
            d["role"],
            d["node"],
            d["rank"] if d["role"] == ROLE_TRAINER else d["node_rank"].replace("-", "None"),
        )
        for d in landed
    )
    assert got == want
