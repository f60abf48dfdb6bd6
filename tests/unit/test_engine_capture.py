"""`CaptureEngine.capture` around a stand-in `LLM`: batches, the publish wait, fail-closed rules.

A capture call runs one request per `generate()` and waits once, after its last prompt, for the
stages' publish reports (`_drain`); these tests pin that down without starting vLLM: the wait runs
once per call, every manifest of the call is returned only after every stage reported, and any
failure (an earlier sample's writer, a missing manifest, reports that never come) fails the whole
call, names what it waited for, and leaves the engine refusing further captures.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="capture() builds vLLM's SamplingParams and TokensPrompt")

import hpctoolkit.engine.engine as engine_mod
from hpctoolkit.capture import Manifest, build_manifest
from hpctoolkit.engine.config import EngineConfig
from hpctoolkit.engine.connector import MANIFEST_PARAM, write_fault
from hpctoolkit.engine.engine import CaptureEngine
from hpctoolkit.errors import ConfigError, DataIntegrityError, StoreError

pytestmark = pytest.mark.timeout(60)

NUM_LAYERS, HIDDEN = 6, 8
CAPTURE_IDS = [1, 3, 5, 6]


def _manifest(i: int, num_tokens: int, pp_size: int) -> dict:
    return build_manifest(
        sample_key=f"run-e0-{i}",
        capture_ids=CAPTURE_IDS,
        num_tokens=num_tokens,
        hidden_size=HIDDEN,
        num_layers=NUM_LAYERS,
        pp_size=pp_size,
        dtype="bfloat16",
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
        assert len(prompts) == 1  # one request per generate(): batch composition is fixed
        assert params.max_tokens == 1
        ids = list(prompts[0]["prompt_token_ids"])
        i = len(self.generated)
        self.generated.append(ids)
        self.pending += 1
        raw = None if i in self.missing else _manifest(i, len(ids), self.pp_size)
        return [SimpleNamespace(request_id=str(i), kv_transfer_params={MANIFEST_PARAM: raw} if raw else None)]

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


def _engine(llm: _FakeLLM, *, in_process: bool, fault_dir: str | None = None) -> CaptureEngine:
    eng = object.__new__(CaptureEngine)
    eng._llm, eng._fault_dir, eng._broken, eng._captured = llm, fault_dir, None, 0
    eng.reaped, eng.in_process, eng.pp_size = [], in_process, llm.pp_size
    eng.cfg = EngineConfig(target_layer_ids=[0, 2, 4], pp_size=llm.pp_size, gpus_per_node=llm.pp_size)
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
    assert llm.generated == prompts  # one request per generate(), in order
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
