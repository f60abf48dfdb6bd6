"""The embedded run behind `make run`, end to end on real parts (shortened, same code path)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_run_path_end_to_end(tmp_path):
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "hpctoolkit.submit",
        "recipes/local.yaml",
        f"paths.output_dir={out}",
        "data.num_samples=12",
        "data.regenerate_tokens=32",
        "training.steps=20",
        "training.checkpoint_every=10",
        "evaluate.num_prompts=3",
        "evaluate.max_tokens=16",
    ]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=880, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "[hpctoolkit] done in" in r.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["samples_published"] == 12
    assert s["samples_read"] == 12
    assert s["keys_left_in_store"] == 0
    assert s["bytes_moved"] > 0
    assert s["steps_trained"] == 20
    assert s["final_loss"] > 0
    assert s["acceptance_length"] >= 1.0
    assert s["served_acceptance_length"] >= 1.0
    assert s["wall_seconds"] > 0
    # What a person looks for after a run.
    assert (out / "config.yaml").is_file()
    assert (out / "export" / "config.json").is_file()
    assert (out / "acceptance_per_position.png").is_file()
    assert list((out / "tensorboard").iterdir())
    assert list((out / "checkpoints").iterdir())


@pytest.mark.real
@pytest.mark.timeout(120)
def test_unreachable_given_master_fails_fast_and_names_it(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpctoolkit.submit",
            "recipes/local.yaml",
            f"paths.output_dir={tmp_path / 'run'}",
            "store.master_address=127.0.0.1:9",
            "data.regenerate_tokens=0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
    )
    assert r.returncode != 0
    assert "127.0.0.1:9" in r.stderr
    assert "Traceback" not in r.stderr
