"""Regeneration with the engine's own PP x TP layout on one node: a PP=2 engine (vLLM-CPU, two
worker processes) gives the same greedy responses as one device, with the capture parts left out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(900)]

ARM = """
import json, sys
from hpctoolkit.engine.config import EngineConfig
from hpctoolkit.engine.regenerate import CAPTURE_ONLY_KEYS, Sampling, generation_kwargs, vllm_generator
target, pp = sys.argv[1], int(sys.argv[2])
# Compiled at both sizes: CPU PP needs the compile warm-up, and eager decode rounds differently.
cfg = EngineConfig(target_layer_ids=[1, 2, 3], pp_size=pp, gpus_per_node=pp, dtype="bfloat16",
                   max_model_len=256, max_num_batched_tokens=64, enforce_eager=False)
kwargs, env = generation_kwargs(cfg, target)
assert not set(CAPTURE_ONLY_KEYS) & set(kwargs) and kwargs["pipeline_parallel_size"] == pp
gen = vllm_generator(target, Sampling(16), 256, kwargs, env)
prompts = json.loads(sys.argv[3])
print("OUT " + json.dumps(gen(prompts, [16] * len(prompts), [0] * len(prompts))))
"""


def arm(target: str, pp: int, prompts: list[list[int]]) -> list:
    r = subprocess.run(
        [sys.executable, "-c", ARM, target, str(pp), json.dumps(prompts)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(next(x for x in r.stdout.splitlines() if x.startswith("OUT "))[4:])


def test_pp2_regeneration_equals_one_device():
    from transformers import AutoTokenizer

    from hpctoolkit.data.prompts import load_prompt_ids
    from hpctoolkit.targets.resolve import resolve_target

    target = str(resolve_target("builtin:tiny-qwen3"))
    prompts = load_prompt_ids("builtin:tiny", AutoTokenizer.from_pretrained(target), 3, 64)
    one, two = arm(target, 1, prompts), arm(target, 2, prompts)
    assert [ids for ids, _ in one] == [ids for ids, _ in two]
    assert all(len(ids) == 16 for ids, _ in one)
