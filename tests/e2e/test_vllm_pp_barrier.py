"""The PP completion barrier: a sample is complete only once every stage published its fragments.

Design. Each stage's TP-rank-0 worker publishes the fragments it owns (on its publisher thread
under PP, handed the sample with the step after the request's last prompt token), and reports the
request in `finished_sending` from `get_finished` only once the put completed. vLLM's
`KVOutputAggregator` (built from `connector.get_finished_count()`, which `HpcHiddenStatesConnector`
sets to the PP size) gathers every rank's `ModelRunnerOutput` and releases a request id to the
scheduler only after that many reports; until then the scheduler keeps the request's blocks
(`request_finished` returned `delay_free=True`) and the engine's `capture()` does not return its
manifest. A stage whose put fails reports nothing and raises, so the request never completes.
(The reference `ExampleHiddenStatesConnector` returns 1, which would declare a PP sample complete
after whichever stage reported first.)

Two tests: the aggregator itself, fed stage outputs directly (fast); and a PP=2 engine whose stage-1
store client fails every put (a test-only store factory, passed through `CaptureEngine`'s
`store_factory`): `capture()` must raise the store error naming stage 1 and return no manifest,
whether the call captures that one prompt or it is the first of three in one call (the wait for
the stages' reports then comes once, after the third). After the engine's shutdown none of the
processes it started may be left: the failing stage's EngineCore dies, and its workers, re-parented
to init, once kept spinning after the test had finished.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parents[1]
FAIL_STAGE = 1
INJECTED = "injected put failure"


# ---------------------------------------------------------------- test-only store factory


class _FailingPutStore:
    """Wraps the production store; every put raises, as a full or unreachable segment would."""

    def __init__(self, inner: Any, stage: int):
        self._inner = inner
        self._stage = stage

    def put_many(self, items: Any) -> None:
        from hpctoolkit.errors import StoreError

        keys = [k for k, _ in items]
        raise StoreError(f"{INJECTED} on PP stage {self._stage} (test only): {keys[:2]}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def failing_stage1_store(address: str, cfg: Any, role: str) -> Any:
    """`store_factory` for the engine: the production `MooncakeStore`, failing on PP stage 1."""
    from vllm.distributed.parallel_state import get_pp_group

    from hpctoolkit.store.mooncake import MooncakeStore

    inner = MooncakeStore(address, cfg, role)
    if get_pp_group().rank_in_group == FAIL_STAGE:
        return _FailingPutStore(inner, FAIL_STAGE)
    return inner


# ---------------------------------------------------------------- the aggregator


def _stage_output(finished: set[str] | None):
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    return ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(finished_sending=finished))


def _aggregator(pp_size: int):
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    from hpctoolkit.engine.connector import HpcHiddenStatesConnector

    count = HpcHiddenStatesConnector.get_finished_count(SimpleNamespace(_pp_size=pp_size))  # type: ignore[arg-type]
    assert count == pp_size
    return KVOutputAggregator(count)


def _step(agg, per_stage: list[set[str] | None]) -> set[str]:
    out = agg.aggregate([_stage_output(f) for f in per_stage], output_rank=len(per_stage) - 1)
    return set(out.kv_connector_output.finished_sending or ())


@pytest.mark.real
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pp_size", [2, 3])
def test_sample_completes_only_after_every_stage_reported(pp_size):
    pytest.importorskip("vllm", reason="vLLM (the 'engine' extra) is not installed")
    agg = _aggregator(pp_size)
    # Stage 0 published and reports; the others have not (yet): not complete, in any later step.
    assert _step(agg, [{"r"}] + [None] * (pp_size - 1)) == set()
    assert _step(agg, [None] * pp_size) == set()
    # The remaining stages report in different steps; completion comes with the last one only.
    for stage in range(1, pp_size):
        done = _step(agg, [{"r"} if s == stage else None for s in range(pp_size)])
        assert done == ({"r"} if stage == pp_size - 1 else set()), stage
    # Another request, all stages in one step: complete at once.
    assert _step(agg, [{"q"}] * pp_size) == {"q"}


@pytest.mark.real
@pytest.mark.timeout(120)
def test_a_stage_that_never_reports_keeps_the_sample_incomplete_and_count_1_would_not():
    pytest.importorskip("vllm", reason="vLLM (the 'engine' extra) is not installed")
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

    ours = _aggregator(2)
    assert _step(ours, [{"r"}, None]) == set()  # stage 0 published and reported, once
    for _ in range(50):  # stage 1's put failed: it never reports
        assert _step(ours, [None, None]) == set()
    # The count the reference connector uses would have released the sample on stage 0 alone.
    reference = KVOutputAggregator(1)
    assert _step(reference, [{"r"}, None]) == {"r"}


# ---------------------------------------------------------------- a real PP=2 engine


def run_faulty(args: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: PP=2 engine whose stage-1 puts fail; try to capture one prompt."""
    from hpctoolkit.engine.config import EngineConfig
    from hpctoolkit.engine.engine import CaptureEngine
    from hpctoolkit.store.config import StoreConfig

    cfg = EngineConfig(
        target_layer_ids=[0, 2, 4],
        gpus_per_node=2,
        pp_size=2,
        dtype="bfloat16",
        max_model_len=512,
        max_num_batched_tokens=64,
        enforce_eager=True,
    )
    result: dict[str, Any] = {"manifests": 0, "error_type": None}
    t0 = time.monotonic()
    with CaptureEngine(
        cfg,
        args["model_dir"],
        args["address"],
        StoreConfig(),
        "barrier",
        store_factory="test_vllm_pp_barrier:failing_stage1_store",
    ) as eng:
        result["engine_start_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        try:
            # The first prompt's stage-1 put fails; with several prompts in one call the failure
            # surfaces while later prompts run or during the call's final wait.
            batch = [list(range(5 + i, 45 + 7 * i)) for i in range(int(args.get("prompts", 1)))]
            result["manifests"] = len(eng.capture(batch))
        except Exception as err:
            result.update(
                error_type=type(err).__name__, message=str(err)[:2000], seconds_to_error=time.monotonic() - t1
            )
    result["engine_pids"] = eng.engine_pids
    result["reaped"] = eng.reaped  # what vLLM's own shutdown left and ours ended
    result["left_running"] = _running(eng.engine_pids)
    return result


def _running(pids: list[int]) -> list[str]:
    import psutil

    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("num_prompts", [1, 3], ids=["one-prompt", "first-of-three"])
def test_failed_put_on_one_stage_fails_the_sample(tmp_path, num_prompts):
    pytest.importorskip("mooncake.store", reason="mooncake (the 'engine' extra) is not importable")
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake_master import launch_master
    from hpctoolkit.targets.resolve import resolve_target

    model_dir = str(resolve_target("builtin:tiny-qwen3"))
    log = tmp_path / "engine.log"
    with launch_master(StoreConfig(), tmp_path / "master-logs") as master:
        args = {"model_dir": model_dir, "address": master.address, "prompts": num_prompts}
        # The workers import the factory by module name: this folder goes on their path.
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{HERE}", PYTHONUNBUFFERED="1")
        with log.open("w") as f:
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), json.dumps(args)],
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO),
                timeout=420,
                check=False,
            )
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("RESULT ")]
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}; log tail:\n{tail}"
    result = json.loads(lines[-1].removeprefix("RESULT "))
    print(f"\n[measure] PP=2, stage {FAIL_STAGE} put fails, {num_prompts} prompt(s): {json.dumps(result)}")
    assert result["manifests"] == 0, "a sample missing stage 1's fragments was reported complete"
    assert result["error_type"] == "StoreError", result
    assert INJECTED in result["message"] and f"stage {FAIL_STAGE}" in result["message"], result
    assert len(result["engine_pids"]) >= 3, result  # EngineCore and the two stages' workers
    assert result["left_running"] == [], result
    assert _running(result["engine_pids"]) == [], "an engine process outlived the capturing process"


if __name__ == "__main__":
    print("RESULT " + json.dumps(run_faulty(json.loads(sys.argv[1]))), flush=True)
