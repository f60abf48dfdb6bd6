"""`HpcHiddenStatesConnector` driven directly, without an engine: lifecycle, PP stages, faults.

The connector is built from a stand-in `VllmConfig` and bound to a hand-made cache-only layer, so
every rule is checked in seconds: the scheduler side follows prompts and blocks through the
scheduler outputs and hands a sample out with the step after its last prompt token, once; no
partial or aborted sample; TP rank 0 only; each PP stage publishes exactly its own fragments,
before the step's forward; `finished_sending` only after a successful publish; a failing put
raises (and leaves a fault record); `get_finished_count() == pp_size`.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the connector subclasses vLLM's KVConnectorBase_V1")

import engine_helpers
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from hpctoolkit.capture import Manifest
from hpctoolkit.data.sample import Sample
from hpctoolkit.engine.connector import (
    EXTRA_CONFIG_KEY,
    MANIFEST_PARAM,
    HpcConnectorMetadata,
    HpcHiddenStatesConnector,
    read_faults,
)
from hpctoolkit.errors import StoreError
from hpctoolkit.store.fragments import fetch_sample

pytestmark = pytest.mark.timeout(120)

NUM_LAYERS, HIDDEN, BLOCK = 6, 8, 4
CAPTURE_IDS = [1, 3, 5, 6]


@pytest.fixture(autouse=True)
def _fresh_store(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    engine_helpers.MEMORY_STORE.clear()


def _connector(role, *, pp_size=1, fault_dir=None, dtype=torch.float32):
    extra = {
        "run_prefix": "run-e0",
        "store_address": None,
        "store_factory": "engine_helpers:memory_store_factory",
        "fault_dir": fault_dir,
    }
    kv_transfer = SimpleNamespace(
        get_from_extra_config={EXTRA_CONFIG_KEY: extra}.get,
        is_kv_producer=True,
    )
    cfg = SimpleNamespace(
        kv_transfer_config=kv_transfer,
        speculative_config=SimpleNamespace(
            method="extract_hidden_states",
            draft_model_config=SimpleNamespace(
                hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=CAPTURE_IDS)
            ),
        ),
        model_config=SimpleNamespace(
            hf_text_config=SimpleNamespace(num_hidden_layers=NUM_LAYERS),
            get_hidden_size=lambda: HIDDEN,
            dtype=dtype,
        ),
        parallel_config=SimpleNamespace(pipeline_parallel_size=pp_size),
        cache_config=SimpleNamespace(block_size=BLOCK),
    )
    return HpcHiddenStatesConnector(cfg, role, None)


def _request(req_id="r1", n=6, computed=None, status=RequestStatus.FINISHED_LENGTH_CAPPED):
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(range(100, 100 + n)),
        num_computed_tokens=n if computed is None else computed,
        status=status,
    )


def _cache(num_heads=None, blocks=8, dtype=torch.float32):
    num_heads = len(CAPTURE_IDS) if num_heads is None else num_heads
    torch.manual_seed(0)
    return torch.randn(blocks, num_heads, BLOCK, HIDDEN).to(dtype)


def _sched_out(new=(), cached=(), resumed=(), preempted=()):
    """A scheduler output: `new` = (req_id, prompt, blocks, computed, scheduled) per new request,
    `cached` = (req_id, new_blocks or None, computed, scheduled) per running one."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, prompt_token_ids=p, block_ids=(list(b),), num_computed_tokens=c)
            for r, p, b, c, _ in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, *_ in cached],
            resumed_req_ids=set(resumed),
            new_block_ids=[None if b is None else (list(b),) for _, b, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached],
        ),
        num_scheduled_tokens={r: n for r, *_, n in list(new) + list(cached)},
        preempted_req_ids=set(preempted),
    )


def _finish(sched, req):
    delay, params = sched.request_finished(req, [5, 2])
    meta = sched.build_connector_meta(_sched_out())
    return delay, params, meta


def test_finished_request_yields_manifest_and_pending_save():
    sched = _connector(KVConnectorRole.SCHEDULER)
    delay, params, meta = _finish(sched, _request())
    assert delay is True  # blocks stay until the workers published
    m = Manifest.from_dict(params[MANIFEST_PARAM])
    assert m.sample_key.startswith("run-e0-")
    assert m.layer_ids == CAPTURE_IDS
    assert m.num_tokens == 6
    assert m.extra["last_hidden_states_prenorm"] is True
    assert isinstance(meta, HpcConnectorMetadata)
    assert [p.req_id for p in meta.pending] == ["r1"]
    assert meta.pending[0].block_ids == [5, 2]
    # Handed over once: the next step carries nothing.
    assert sched.build_connector_meta(_sched_out()).pending == []


@pytest.mark.parametrize(
    "req",
    [
        _request(computed=4),  # finished before its last prefill chunk ran
        _request(status=RequestStatus.FINISHED_ABORTED),
    ],
    ids=["partial-prefill", "aborted"],
)
def test_partial_or_aborted_request_is_never_published(req):
    sched = _connector(KVConnectorRole.SCHEDULER)
    delay, params, meta = _finish(sched, req)
    assert (delay, params) == (False, None)
    assert meta.pending == []


def _chunks(sched, req_id="r1", n=10, chunk=4):
    """Schedule an n-token prompt in chunks of `chunk` tokens (block size 4: one new block each)."""
    prompt = list(range(100, 100 + n))
    metas, blocks = [], [5, 2, 7, 1, 9][: -(-n // BLOCK)]
    for step, start in enumerate(range(0, n, chunk)):
        todo = min(chunk, n - start)
        step_blocks = blocks[start // BLOCK : (start + todo + BLOCK - 1) // BLOCK]
        if step == 0:
            out = _sched_out(new=[(req_id, prompt, step_blocks, 0, todo)])
        else:
            out = _sched_out(cached=[(req_id, step_blocks, start, todo)])
        metas.append(sched.build_connector_meta(out))
    return prompt, blocks, metas


def test_sample_is_handed_out_with_the_step_after_its_last_prompt_token():
    """PP > 1: the next step is scheduled while the last chunk is still in flight."""
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    prompt, blocks, metas = _chunks(sched)
    assert [m.pending for m in metas] == [[], [], []]  # chunk 3 completes the prompt
    (sample,) = sched.build_connector_meta(_sched_out()).pending  # the next (here empty) step
    assert (sample.req_id, sample.block_ids, sample.token_ids) == ("r1", blocks, prompt)
    m = Manifest.from_dict(sample.manifest)
    assert m.num_tokens == 10 and m.pp_size == 2
    # The request's output is processed afterwards: the manifest it returns is the one handed out.
    delay, params = sched.request_finished(_request(n=10), blocks)
    assert delay is True and params == {MANIFEST_PARAM: sample.manifest}
    assert sched.build_connector_meta(_sched_out()).pending == []  # once


def test_pp1_request_finishes_before_its_sample_is_handed_out():
    sched = _connector(KVConnectorRole.SCHEDULER)
    _, blocks, _ = _chunks(sched)
    delay, params = sched.request_finished(_request(n=10), blocks)
    assert delay is True
    (sample,) = sched.build_connector_meta(_sched_out()).pending
    assert params == {MANIFEST_PARAM: sample.manifest}
    assert sched.build_connector_meta(_sched_out()).pending == []


def test_aborted_request_is_published_only_if_already_handed_out():
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    _, blocks, _ = _chunks(sched)
    aborted = _request(n=10, status=RequestStatus.FINISHED_ABORTED)
    assert sched.request_finished(aborted, blocks) == (False, None)  # not handed out yet
    assert sched.build_connector_meta(_sched_out()).pending == []
    _, blocks, _ = _chunks(sched, "r2")
    assert len(sched.build_connector_meta(_sched_out()).pending) == 1  # the stages publish it
    aborted2 = SimpleNamespace(**{**vars(aborted), "request_id": "r2"})
    # Blocks held until every stage reported; no manifest goes to the client.
    assert sched.request_finished(aborted2, blocks) == (True, None)


def test_blocks_that_differ_from_the_ones_handed_out_fail_closed(tmp_path):
    from hpctoolkit.errors import DataIntegrityError

    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2, fault_dir=str(tmp_path))
    _chunks(sched)
    sched.build_connector_meta(_sched_out())
    with pytest.raises(DataIntegrityError, match=r"handed out with blocks \[5, 2, 7\]"):
        sched.request_finished(_request(n=10), [5, 2, 8])
    assert read_faults(str(tmp_path))[0]["where"] == "engine core, finishing request r1"


def test_resumed_request_replaces_its_blocks_and_is_handed_out_once():
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    prompt = list(range(100, 110))
    sched.build_connector_meta(_sched_out(new=[("r1", prompt, [5], 0, 4)]))
    # Preempted and resumed from scratch in other blocks.
    sched.build_connector_meta(_sched_out(cached=[("r1", [3, 4, 6], 0, 10)], resumed=["r1"]))
    (sample,) = sched.build_connector_meta(_sched_out()).pending
    assert sample.block_ids == [3, 4, 6]
    # Seen again as a new request after its sample was handed out: not a second sample.
    sched.build_connector_meta(_sched_out(new=[("r1", prompt, [8, 9, 10], 0, 10)]))
    assert sched.build_connector_meta(_sched_out()).pending == []


def test_never_scheduled_request_has_no_group_blocks():
    sched = _connector(KVConnectorRole.SCHEDULER)
    assert sched.request_finished_all_groups(_request(), ()) == (False, None)


def _worker(pp_rank=0, tp_rank=0, pp_size=1, kv=None, **kw):
    w = _connector(KVConnectorRole.WORKER, pp_size=pp_size, **kw)
    w._bind_cache(_cache() if kv is None else kv, pp_rank, tp_rank)
    return w


def _step(worker, meta, finished):
    worker.bind_connector_metadata(meta)
    try:
        return worker.get_finished(finished)[0]
    finally:
        worker.clear_connector_metadata()


def test_worker_publishes_rows_then_reports_sent():
    sched = _connector(KVConnectorRole.SCHEDULER)
    _, params, meta = _finish(sched, _request())
    m = Manifest.from_dict(params[MANIFEST_PARAM])
    kv = _cache()
    worker = _worker(kv=kv)
    assert _step(worker, meta, {"r1"}) == {"r1"}
    sample: Sample = fetch_sample(engine_helpers.MEMORY_STORE, m, retry_max_wait_s=1)
    # Tokens 0..3 sit in block 5, tokens 4..5 in block 2.
    want = torch.cat([kv[5].permute(1, 0, 2), kv[2, :, :2].permute(1, 0, 2)])  # [T, heads, H]
    for j, k in enumerate(CAPTURE_IDS[:-1]):
        assert torch.equal(sample.aux_hidden_states[j], want[:, j]), k
    assert torch.equal(sample.last_hidden_states, want[:, -1])
    assert sample.input_ids.tolist() == list(range(100, 106))
    assert engine_helpers.MEMORY_STORE.keys() == []  # fetch removed what it read


def test_worker_publishes_before_the_steps_forward():
    """The publish happens when the step's metadata is bound, before vLLM runs the forward."""
    sched = _connector(KVConnectorRole.SCHEDULER)
    _, params, meta = _finish(sched, _request())
    m = Manifest.from_dict(params[MANIFEST_PARAM])
    worker = _worker()
    worker.bind_connector_metadata(meta)
    assert sorted(engine_helpers.MEMORY_STORE.keys()) == sorted(f.key for f in m.all_objects)
    assert worker.get_finished(set())[0] is None  # reported once vLLM lists it finished
    assert worker.num_published == 0  # counted when reported
    assert worker.get_finished({"r1"})[0] == {"r1"}
    assert worker.num_published == 1
    worker.clear_connector_metadata()


def test_sent_reported_only_once_finished_ids_arrive():
    sched = _connector(KVConnectorRole.SCHEDULER)
    _, _, meta = _finish(sched, _request())
    worker = _worker()
    assert _step(worker, meta, set()) is None
    assert _step(worker, HpcConnectorMetadata(), {"r1"}) == {"r1"}
    assert _step(worker, HpcConnectorMetadata(), set()) is None


def test_only_tp_rank_zero_publishes():
    sched = _connector(KVConnectorRole.SCHEDULER)
    _, _, meta = _finish(sched, _request())
    assert _step(_worker(tp_rank=1), meta, {"r1"}) is None
    assert engine_helpers.MEMORY_STORE.keys() == []


@pytest.mark.parametrize("layout", ["global-heads", "local-heads"])
def test_pp_stages_publish_their_own_fragments(layout):
    """Two stages of a 6-layer target: stage 0 owns ids 1, 3 (+input_ids), stage 1 owns 5, 6."""
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    assert sched.get_finished_count() == 2  # blocks freed only when both stages reported
    _, params, meta = _finish(sched, _request())
    m = Manifest.from_dict(params[MANIFEST_PARAM])
    reports = []
    for stage, owned in ((0, [1, 3]), (1, [5, 6])):
        heads = len(CAPTURE_IDS) if layout == "global-heads" else len(owned)
        kv = _cache(num_heads=heads)
        worker = _worker(pp_rank=stage, pp_size=2, kv=kv)
        worker.bind_connector_metadata(meta)
        _settle(worker)
        reports.append(worker.get_finished({"r1"})[0])
        objs = {f.key for f in m.fragments_of_stage(stage)}
        assert objs <= set(engine_helpers.MEMORY_STORE.keys())
    assert reports == [{"r1"}, {"r1"}]
    assert sorted(engine_helpers.MEMORY_STORE.keys()) == sorted(f.key for f in m.all_objects)


def test_failing_put_raises_and_records_fault(tmp_path):
    sched = _connector(KVConnectorRole.SCHEDULER)
    _, params, meta = _finish(sched, _request())
    m = Manifest.from_dict(params[MANIFEST_PARAM])
    engine_helpers.MEMORY_STORE.fail_puts_for = {m.last.key}
    worker = _worker(fault_dir=str(tmp_path))
    with pytest.raises(StoreError, match="injected"):
        _step(worker, meta, {"r1"})
    (fault,) = read_faults(str(tmp_path))
    assert fault["type"] == "StoreError" and "injected" in fault["message"]
    # Nothing was reported sent, so vLLM keeps the blocks.
    assert _step(worker, HpcConnectorMetadata(), set()) is None


def test_cache_shape_and_dtype_checked():
    from hpctoolkit.errors import DataIntegrityError

    with pytest.raises(DataIntegrityError, match="heads"):
        _worker(kv=_cache(num_heads=3))
    sched = _connector(KVConnectorRole.SCHEDULER)
    _, _, meta = _finish(sched, _request())
    worker = _worker(kv=_cache(dtype=torch.bfloat16))  # manifest says float32
    with pytest.raises(DataIntegrityError, match="dtype"):
        _step(worker, meta, {"r1"})


# ------------------------------------------------------------------ CaptureEngine around a fake LLM


class _FakeLLM:
    """Stands in for `vllm.LLM` in-process: `generate` gives what the test says."""

    def __init__(self, outputs=None, error=None):
        self.outputs, self.error, self.calls = outputs, error, 0
        scheduler = SimpleNamespace(has_requests=lambda: False)
        self.llm_engine = SimpleNamespace(
            engine_core=SimpleNamespace(
                engine_core=SimpleNamespace(scheduler=scheduler), shutdown=lambda: None
            )
        )

    def generate(self, prompts, params, use_tqdm):
        self.calls += 1
        assert len(prompts) == 1  # one request per generate(): batch composition is fixed
        assert params.max_tokens == 1
        if self.error is not None:
            raise self.error
        return self.outputs


def _engine_around(llm, fault_dir):
    from hpctoolkit.engine.config import EngineConfig
    from hpctoolkit.engine.engine import CaptureEngine

    eng = object.__new__(CaptureEngine)
    eng._llm, eng._fault_dir, eng._broken, eng._captured = llm, fault_dir, None, 0
    eng.reaped, eng.in_process, eng.pp_size = [], True, 1
    eng.cfg = EngineConfig(target_layer_ids=[0, 2, 4])
    return eng


def test_capture_without_manifest_is_a_data_integrity_error(tmp_path):
    from hpctoolkit.errors import DataIntegrityError

    eng = _engine_around(_FakeLLM(outputs=[SimpleNamespace(kv_transfer_params=None, request_id="0")]), None)
    with pytest.raises(DataIntegrityError, match="no manifest"):
        eng.capture([[1, 2, 3]])


def test_engine_death_is_reported_as_the_writers_store_error(tmp_path):
    from hpctoolkit.engine.connector import write_fault

    write_fault(str(tmp_path), "stage 0 publish of 7", StoreError("put of 'k' to master 1.2.3.4:5 failed"))
    llm = _FakeLLM(error=RuntimeError("EngineDeadError: EngineCore encountered an issue"))
    eng = _engine_around(llm, str(tmp_path))
    with pytest.raises(StoreError, match=r"1\.2\.3\.4:5") as info:
        eng.capture([[1, 2, 3]])
    assert isinstance(info.value.__cause__, RuntimeError)
    # The engine is not used again after a failure.
    with pytest.raises(StoreError, match="earlier failure"):
        eng.capture([[1, 2, 3]])
    assert llm.calls == 1


def test_worker_checks_reachability_at_start_and_builds_no_client(tmp_path, monkeypatch):
    import socket

    import hpctoolkit.engine.connector as conn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    extra = {
        "run_prefix": "run-e0",
        "store_address": f"127.0.0.1:{port}",
        "connect_timeout_s": 2.0,
        "fault_dir": str(tmp_path),
    }
    monkeypatch.setattr(conn.ExtraConfig, "from_dict", classmethod(lambda cls, d: cls(**extra)))
    # The scheduler side never touches the store.
    _connector(KVConnectorRole.SCHEDULER)
    with pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
        _connector(KVConnectorRole.WORKER)
    assert read_faults(str(tmp_path))[0]["where"].startswith("worker start")


def test_worker_store_client_is_lazy():
    worker = _worker()
    assert worker._store is None  # nothing registered while vLLM profiles memory


# ------------------------------------------------------------------ PP > 1: the publisher thread


def _settle(worker, timeout_s=10.0):
    """Wait until the worker's publisher thread ran every job handed to it (or stopped)."""
    pub = worker._publisher
    deadline = time.monotonic() + timeout_s
    while pub is not None and pub._done.qsize() < pub.in_flight and pub._thread.is_alive():
        assert time.monotonic() < deadline, "the publisher thread did not finish its jobs"
        time.sleep(0.001)


class _GatedStore:
    """Wraps the test store; every put waits until the test opens the gate."""

    def __init__(self, inner):
        self.inner, self.gate, self.entered = inner, threading.Event(), threading.Event()

    def put_many(self, items):
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        self.inner.put_many(items)

    def close(self):
        pass


def test_pp_stage_publishes_on_its_thread_and_reports_once_complete():
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    _, params, meta = _finish(sched, _request())
    m = Manifest.from_dict(params[MANIFEST_PARAM])
    worker = _worker(pp_rank=1, pp_size=2, kv=_cache())
    store = _GatedStore(engine_helpers.MEMORY_STORE)
    worker._store = store
    t0 = time.monotonic()
    assert _step(worker, meta, {"r1"}) is None  # the step does not wait for the put
    assert store.entered.wait(10) and time.monotonic() - t0 < 5
    assert _step(worker, HpcConnectorMetadata(), set()) is None
    assert worker.num_published == 0
    store.gate.set()
    _settle(worker)
    assert worker.num_published == 0  # counted by the step that collects it, with its report
    assert _step(worker, HpcConnectorMetadata(), set()) == {"r1"}
    assert worker.num_published == 1
    stage1 = {f.key for f in m.fragments_of_stage(1)}
    assert stage1 == set(engine_helpers.MEMORY_STORE.keys())
    assert _step(worker, HpcConnectorMetadata(), set()) is None  # reported once


def test_pp_stage_failure_is_raised_by_the_next_step_and_stops_its_thread(tmp_path):
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    _, params, meta = _finish(sched, _request())
    m = Manifest.from_dict(params[MANIFEST_PARAM])
    _, params2, meta2 = _finish(sched, _request("r2"))
    m2 = Manifest.from_dict(params2[MANIFEST_PARAM])
    engine_helpers.MEMORY_STORE.fail_puts_for = {m.last.key}
    worker = _worker(pp_rank=1, pp_size=2, fault_dir=str(tmp_path))
    worker.bind_connector_metadata(HpcConnectorMetadata(pending=meta.pending + meta2.pending))
    _settle(worker)
    with pytest.raises(StoreError, match="injected"):
        worker.get_finished({"r1", "r2"})
    (fault,) = read_faults(str(tmp_path))
    assert fault["where"] == "stage 1 publish of r1" and "injected" in fault["message"]
    # Nothing reported; the sample queued behind the failure is never published.
    assert _step(worker, HpcConnectorMetadata(), set()) is None
    assert worker.num_published == 0
    assert not {f.key for f in m2.all_objects} & set(engine_helpers.MEMORY_STORE.keys())


def test_shutdown_lets_the_queued_publishes_finish():
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    _, params, meta = _finish(sched, _request())
    m = Manifest.from_dict(params[MANIFEST_PARAM])
    worker = _worker(pp_rank=0, pp_size=2)
    worker.bind_connector_metadata(meta)
    worker.clear_connector_metadata()
    worker.shutdown()
    assert {f.key for f in m.fragments_of_stage(0)} == set(engine_helpers.MEMORY_STORE.keys())
    assert worker._publisher is None


# ------------------------------------------------------------------ aborts and preemption after hand-out


def _stages(pp_size=2, kv=None):
    return [_worker(pp_rank=r, pp_size=pp_size, kv=kv) for r in range(pp_size)]


def _bind_all(workers, meta):
    for w in workers:
        w.bind_connector_metadata(meta)
        _settle(w)


def test_fragments_of_a_request_aborted_after_hand_out_are_removed():
    """The stages publish it regardless; nobody reads it, and a hard-pinned store never evicts it."""
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    _, blocks, _ = _chunks(sched)
    meta = sched.build_connector_meta(_sched_out())
    (sample,) = meta.pending
    m = Manifest.from_dict(sample.manifest)
    workers = _stages()
    _bind_all(workers, meta)
    assert sorted(engine_helpers.MEMORY_STORE.keys()) == sorted(f.key for f in m.all_objects)
    aborted = _request(n=10, status=RequestStatus.FINISHED_ABORTED)
    assert sched.request_finished(aborted, blocks) == (True, None)  # blocks held until reported
    meta = sched.build_connector_meta(_sched_out())
    assert meta.pending == [] and [d.req_id for d in meta.discard] == ["r1"]
    _bind_all(workers, meta)
    assert engine_helpers.MEMORY_STORE.keys() == []
    # Each stage still reports it once, so vLLM frees its blocks.
    assert [w.get_finished({"r1"})[0] for w in workers] == [{"r1"}, {"r1"}]
    assert sched.build_connector_meta(_sched_out()).discard == []  # once


def test_request_preempted_after_hand_out_is_discarded_and_handed_out_from_its_recompute():
    """vLLM frees the blocks the stages may still read, then recomputes the request elsewhere."""
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    _chunks(sched)
    first = sched.build_connector_meta(_sched_out())
    (old,) = first.pending
    # The next schedule preempts it (KV-cache pressure): its sample is discarded, not republished.
    second = sched.build_connector_meta(_sched_out(preempted=["r1"]))
    assert second.pending == [] and [d.req_id for d in second.discard] == ["r1"]
    # Resumed from scratch in other blocks; its prompt completes again.
    sched.build_connector_meta(_sched_out(cached=[("r1", [3, 4, 6], 0, 10)], resumed=["r1"]))
    third = sched.build_connector_meta(_sched_out())
    (new,) = third.pending
    assert new.block_ids == [3, 4, 6] and new.manifest == old.manifest  # same sample key
    delay, params = sched.request_finished(_request(n=10), [3, 4, 6])
    assert delay is True and params == {MANIFEST_PARAM: new.manifest}

    kv = _cache(num_heads=2, blocks=10)  # the patch's layout: local ids first, 2 heads per stage
    workers = _stages(kv=kv)
    for meta in (first, second, third):
        _bind_all(workers, meta)
    assert [w.get_finished({"r1"})[0] for w in workers] == [{"r1"}, {"r1"}]
    sample = fetch_sample(engine_helpers.MEMORY_STORE, Manifest.from_dict(new.manifest), retry_max_wait_s=1)
    want = torch.cat([kv[3], kv[4], kv[6, :, :2]], dim=1).permute(1, 0, 2)  # [T, heads, H], new blocks
    assert torch.equal(sample.last_hidden_states, want[:, 1])  # stage 1's second local head: id 6
    assert torch.equal(sample.aux_hidden_states[0], want[:, 0])  # stage 0's first: id 1


def test_preempted_request_is_reported_only_once_its_recompute_is_published():
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    _chunks(sched)
    first = sched.build_connector_meta(_sched_out())
    second = sched.build_connector_meta(_sched_out(preempted=["r1"]))
    sched.build_connector_meta(_sched_out(cached=[("r1", [3, 4, 6], 0, 10)], resumed=["r1"]))
    third = sched.build_connector_meta(_sched_out())
    worker = _worker(pp_rank=1, pp_size=2, kv=_cache(blocks=10))
    _bind_all([worker], first)
    _bind_all([worker], second)
    store = _GatedStore(engine_helpers.MEMORY_STORE)
    worker._store = store
    worker.bind_connector_metadata(third)
    assert store.entered.wait(10)
    # The first publish completed, but the recompute's is still running: not reported.
    assert worker.get_finished({"r1"})[0] is None
    store.gate.set()
    _settle(worker)
    assert worker.get_finished(set())[0] == {"r1"}


def test_request_preempted_before_hand_out_is_handed_out_only_from_its_recompute():
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    prompt = list(range(100, 110))
    sched.build_connector_meta(_sched_out(new=[("r1", prompt, [5, 2, 7], 0, 10)]))  # completes
    meta = sched.build_connector_meta(_sched_out(preempted=["r1"]))
    assert (meta.pending, meta.discard) == ([], [])
    sched.build_connector_meta(_sched_out(cached=[("r1", [3, 4, 6], 0, 10)], resumed=["r1"]))
    (sample,) = sched.build_connector_meta(_sched_out()).pending
    assert sample.block_ids == [3, 4, 6]


def test_request_aborted_while_recomputing_holds_its_blocks_for_the_stages_reports():
    sched = _connector(KVConnectorRole.SCHEDULER, pp_size=2)
    _chunks(sched)
    sched.build_connector_meta(_sched_out())
    sched.build_connector_meta(_sched_out(preempted=["r1"]))
    aborted = _request(n=10, computed=0, status=RequestStatus.FINISHED_ABORTED)
    # Its first sample went to the stages, which will report it: vLLM must still know it.
    assert sched.request_finished(aborted, []) == (True, None)
