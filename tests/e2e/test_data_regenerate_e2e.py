"""Regeneration end to end on the local backend (its Slurm twin is in test_slurm_e2e.py, with the
emulated cluster's other tests): the engine leader answers multi-turn chat rows with the target, turn by
turn, before it captures; the captured last turn equals the target's own greedy output for the
same prompt (computed again here, in a vLLM of its own), the loss mask travels through the store,
and the counts are recorded."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from regen_helpers import ROWS, check_regenerated, common_overrides

from hpctoolkit.rundir.layout import RunDir

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.mark.parametrize("replicas", [1, 2])
def test_local_engine_leader_regenerates_turn_by_turn(tmp_path, replicas):
    """The same roles on the local backend (`make run`'s path); with two generating engines side
    by side (`engine.regenerate_replicas=2`), the merged rows are the same as one engine's."""
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
            f"engine.regenerate_replicas={replicas}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    check_regenerated(RunDir.of(out, (out / "latest").resolve().name), target)
