"""`CaptureEngine.capture` around a stand-in `LLM`: batches, the publish wait, fail-closed rules.

A capture call runs `engine.prefill_batch` requests per `generate()` (the batches cut at fixed
sample positions) and waits once, after its last prompt, for the
stages' publish reports (`_drain`); these tests pin that down without starting vLLM: the wait runs
once per call, every manifest of the call is returned only after every stage reported, and any
failure (an earlier sample's writer, a missing manifest, reports that never come) fails the whole
call, names what it waited for, and leaves the engine refusing further captures.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="capture() builds vLLM's SamplingParams and TokensPrompt")

import hpctoolkit.engine.engine as engine_mod
from hpctoolkit.capture import Manifest, build_manifest
from hpctoolkit.engine.config import EngineConfig
from hpctoolkit.engine.connector import MANIFEST_PARAM, write_fault
from hpctoolkit.engine.engine import CaptureEngine
from hpctoolkit.engine.prefill import GROUP_PARAM
from hpctoolkit.errors import ConfigError, DataIntegrityError, StoreError
from hpctoolkit.store.fragments import INPUT_IDS_SHA256, input_ids_digest

pytestmark = pytest.mark.timeout(60)

NUM_LAYERS, HIDDEN = 6, 8
CAPTURE_IDS = [1, 3, 5, 6]


def _manifest(i: int, ids: list[int], pp_size: int) -> dict:
    return build_manifest(
        sample_key=f"run-e0-{i}",
        capture_ids=CAPTURE_IDS,
        num_tokens=len(ids),
        hidden_size=HIDDEN,
        num_layers=NUM_LAYERS,
        pp_size=pp_size,
        dtype="bfloat16",
        extra={INPUT_IDS_SHA256: input_ids_digest(torch.tensor(ids, dtype=torch.long))},
    ).to_dict()


class _FakeLLM:
    """Stands in for `vllm.LLM`: each `generate` finishes one request; the stages publish later.

    `published` is what `collective_rpc("hpctoolkit_published_count")` reports per stage; the test
    (or `publish_after_calls`) moves it on. `missing` are request indices that come back without
    a manifest.
    """

    def __init__(self, pp_size: int = 1, *, missing: frozenset[int] = frozenset(), rpc_blocks=None):
        self.pp_size = pp_size
        self.missing = missing
        self.generated: list[list[int]] = []
        self.calls: list[tuple[int, object]] = []  # (prompts, kv_transfer_params) per generate()
        self.published = [0] * pp_size
        self.rpc_calls: list[int] = []  # how many requests had been generated at each RPC
        self.rpc_blocks = rpc_blocks  # an Event the RPC waits on (an engine that stopped answering)
        self.auto_publish = True
        self.steps = 0
        self.pending = 0  # in-process: finished requests whose blocks the scheduler still holds
        scheduler = SimpleNamespace(has_requests=lambda: self.pending > 0)
        self.llm_engine = SimpleNamespace(
            engine_core=SimpleNamespace(
                engine_core=SimpleNamespace(scheduler=scheduler),
                resources=SimpleNamespace(engine_dead=False),
                shutdown=lambda: None,
            ),
            step=self._step,
        )

    def _step(self) -> None:
        self.steps += 1
        self.pending = 0

    def generate(self, prompts, params, use_tqdm):
        assert params.max_tokens == 1
        self.calls.append((len(prompts), (params.extra_args or {}).get("kv_transfer_params")))
        outs = []
        for prompt in prompts:
            ids = list(prompt["prompt_token_ids"])
            i = len(self.generated)
            self.generated.append(ids)
            self.pending += 1
            raw = None if i in self.missing else _manifest(i, ids, self.pp_size)
            outs.append(
                SimpleNamespace(request_id=str(i), kv_transfer_params={MANIFEST_PARAM: raw} if raw else None)
            )
        return outs

    def collective_rpc(self, method):
        assert method == "hpctoolkit_published_count"
        self.rpc_calls.append(len(self.generated))
        if self.rpc_blocks is not None:
            self.rpc_blocks.wait(30)
        counts = list(self.published)
        if self.auto_publish:
            # The stages catch up with one sample per poll.
            self.published = [min(p + 1, len(self.generated)) for p in self.published]
        return counts


def _engine(
    llm: _FakeLLM, *, in_process: bool, fault_dir: str | None = None, prefill_batch: int = 1
) -> CaptureEngine:
    eng = object.__new__(CaptureEngine)
    eng._llm, eng._fault_dir, eng._broken, eng._captured, eng._groups = llm, fault_dir, None, 0, 0
    eng.reaped, eng.in_process, eng.pp_size = [], in_process, llm.pp_size
    eng.cfg = EngineConfig(
        target_layer_ids=[0, 2, 4],
        pp_size=llm.pp_size,
        gpus_per_node=llm.pp_size,
        prefill_batch=prefill_batch,
        capture_batch=16 * prefill_batch,
    )
    return eng


def _prompts(n: int) -> list[list[int]]:
    return [list(range(5, 5 + 3 + i)) for i in range(n)]


def test_capture_batch_is_a_positive_engine_setting():
    assert EngineConfig().capture_batch >= 1
    with pytest.raises(ConfigError, match="capture_batch must be > 0"):
        EngineConfig(target_layer_ids=[0], capture_batch=0).validate()


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "multiprocess"])
def test_a_batch_waits_once_and_returns_every_manifest_in_order(in_process):
    llm = _FakeLLM(pp_size=1 if in_process else 2)
    eng = _engine(llm, in_process=in_process)
    prompts = _prompts(5)
    manifests = eng.capture(prompts)
    assert llm.generated == prompts and llm.calls == [(1, None)] * 5  # one request per generate()
    assert [m.num_tokens for m in manifests] == [len(p) for p in prompts]
    assert all(isinstance(m, Manifest) for m in manifests)
    assert [m.sample_key for m in manifests] == [f"run-e0-{i}" for i in range(5)]
    if in_process:
        assert llm.steps == 1 and llm.pending == 0  # one drain, after the last prompt
    else:
        # The wait starts only after the last prompt, and lasts until every stage reported all 5.
        assert llm.rpc_calls and set(llm.rpc_calls) == {5}
        assert llm.published == [5, 5]


def test_a_batch_is_not_returned_before_every_stage_published_every_sample():
    llm = _FakeLLM(pp_size=2)
    llm.auto_publish = False
    llm.published = [3, 2]  # stage 1 still owes samples 2 and 3 of 3
    eng = _engine(llm, in_process=False)
    box: dict = {}
    worker = threading.Thread(target=lambda: box.setdefault("m", eng.capture(_prompts(3))), daemon=True)
    worker.start()
    worker.join(0.5)
    assert worker.is_alive() and "m" not in box
    llm.published = [3, 3]
    worker.join(10)
    assert len(box["m"]) == 3


def test_reports_that_never_come_fail_the_batch_naming_what_is_missing(monkeypatch):
    monkeypatch.setattr(engine_mod, "PUBLISH_WAIT_S", 0.3)
    llm = _FakeLLM(pp_size=2)
    llm.auto_publish = False
    llm.published = [4, 3]
    eng = _engine(llm, in_process=False)
    with pytest.raises(DataIntegrityError, match=r"7 of 8 stage publishes reported \(4 samples x 2 stages\)"):
        eng.capture(_prompts(4))
    with pytest.raises(StoreError, match="earlier failure"):
        eng.capture(_prompts(1))


def test_an_earlier_samples_writer_failure_fails_the_whole_batch(tmp_path):
    """Stage 1's put of the batch's first sample failed; its worker died, so the count RPC hangs."""
    write_fault(str(tmp_path), "stage 1 publish of 0", StoreError("put of 'run-e0-0/h1' failed (stage 1)"))
    llm = _FakeLLM(pp_size=2, rpc_blocks=threading.Event())
    eng = _engine(llm, in_process=False, fault_dir=str(tmp_path))
    with pytest.raises(StoreError, match=r"stage 1 publish of 0.*run-e0-0/h1' failed \(stage 1\)"):
        eng.capture(_prompts(3))
    llm.rpc_blocks.set()
    with pytest.raises(StoreError, match="earlier failure"):
        eng.capture(_prompts(1))


def test_a_missing_manifest_stops_the_batch_at_that_prompt():
    llm = _FakeLLM(pp_size=2, missing=frozenset({1}))
    eng = _engine(llm, in_process=False)
    with pytest.raises(DataIntegrityError, match=r"request 1 \(4 tokens\) returned no manifest"):
        eng.capture(_prompts(4))
    assert len(llm.generated) == 2 and llm.rpc_calls == []
    with pytest.raises(StoreError, match="earlier failure"):
        eng.capture(_prompts(1))


def test_every_prompt_is_checked_before_the_first_runs():
    llm = _FakeLLM()
    eng = _engine(llm, in_process=True)
    with pytest.raises(ConfigError, match="prompt 2 of 3 has 2048 tokens"):
        eng.capture([[1, 2], [3], list(range(2048))])
    with pytest.raises(ConfigError, match="empty prompt"):
        eng.capture([[1, 2], []])
    assert llm.generated == []
    assert len(eng.capture([[1, 2]])) == 1  # a refused call does not break the engine


def test_prefill_batches_are_cut_at_fixed_positions_and_carry_their_group():
    llm = _FakeLLM()
    eng = _engine(llm, in_process=True, prefill_batch=4)
    prompts = _prompts(7)
    # A resumed run: positions 2, 5 and 9 were trained on; batch 1 (positions 4..7) is partial.
    positions = [0, 1, 3, 4, 6, 7, 8]
    manifests = eng.capture(prompts, positions)
    assert llm.generated == prompts
    assert [n for n, _ in llm.calls] == [3, 3, 1]  # positions 0-3, 4-7, 8-11
    assert [p[GROUP_PARAM] for _, p in llm.calls] == [["b1", 3], ["b2", 3], ["b3", 1]]
    assert [m.sample_key for m in manifests] == [f"run-e0-{i}" for i in range(7)]
    assert llm.steps == 1  # still one drain per call
    eng.capture(_prompts(2), [12, 13])
    assert llm.calls[-1] == (2, {GROUP_PARAM: ["b4", 2]})  # a new id per batch, never reused


def test_positions_must_increase_and_match_the_prompts():
    eng = _engine(_FakeLLM(), in_process=True, prefill_batch=2)
    with pytest.raises(ValueError, match="2 prompts but 1 positions"):
        eng.capture(_prompts(2), [0])
    with pytest.raises(DataIntegrityError, match="position 1 follows 3"):
        eng.capture(_prompts(2), [3, 1])


def test_a_manifest_of_another_prompt_fails_the_call():
    llm = _FakeLLM()
    real = llm.generate

    def swapped(prompts, params, use_tqdm):
        return real(prompts, params, use_tqdm)[::-1]

    llm.generate = swapped
    eng = _engine(llm, in_process=True, prefill_batch=2)
    with pytest.raises(DataIntegrityError, match="input ids digest is another prompt's"):
        eng.capture([[1, 2, 3], [4, 5, 6]])


@pytest.mark.parametrize(("blocks", "fits"), [(512, True), (511, False), (None, False)])
def test_engine_start_refuses_a_kv_cache_that_cannot_hold_a_prefill_batch(blocks, fits):
    llm = _FakeLLM()
    llm.llm_engine.vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(num_gpu_blocks=blocks, block_size=16)
    )
    eng = _engine(llm, in_process=True, prefill_batch=4)  # 4 x max_model_len 2048 = 512 blocks of 16
    eng._own_fault_dir = False
    if fits:
        eng._check_batch_fits()
        return
    with pytest.raises(
        ConfigError, match=r"^engine.prefill_batch=4 needs KV cache room for 4 x engine.max_model_len=2048"
    ):
        eng._check_batch_fits()
    assert eng._llm is None  # shut down before the refusal
