"""Backpressure: an engine leader pauses capture while its store segment fills up unread.

The gate's rules on fakes (milliseconds), the trainers' per-engine read records it reads, and the
real thing: `run_engine_leader`'s capture loop publishing into a real Mooncake master through a
writer with a small segment (the engine's model is a stand-in that publishes real fragments; no
vLLM), while a slow trainer reads through the production `LiveSource`. Without the pause the
samples would not fit: five times the segment is published, more than the whole store holds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from store_fixtures import HAVE_MOONCAKE, small_store_cfg, tensor_for

from hpctoolkit.capture.manifest import build_manifest
from hpctoolkit.capture.queue import QueueWriter, write_drained
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.roles.backpressure import Backpressure
from hpctoolkit.store import fragments
from hpctoolkit.store.memory import MemoryStore
from hpctoolkit.train.source import LiveSource, ManifestQueues, read_stage_bytes

pytestmark = pytest.mark.timeout(300)
SEG = 1000


class _Manifest:
    """What the gate reads of a manifest: bytes per stage."""

    def __init__(self, *stage_bytes: int) -> None:
        self.stage_bytes = stage_bytes

    def fragments_of_stage(self, s: int) -> list[Any]:
        class F:
            nbytes = self.stage_bytes[s]

        return [F()]


def _gate(
    read: list[int], drained: bool = False, max_pause_s: float = 5.0, log: list[str] | None = None
) -> Backpressure:
    return Backpressure(
        0,
        2,
        SEG,
        0.8,
        0.5,
        max_pause_s,
        lambda: read,
        lambda: drained,
        (log if log is not None else []).append,
        poll_s=0.01,
    )


def test_no_pause_below_the_high_watermark():
    read = [0, 0]
    g = _gate(read)
    g.published(_Manifest(300, 790))
    assert g.unread() == [300, 790]
    assert g.wait() == 0.0 and g.pauses == 0


def test_pause_until_the_fullest_segment_is_below_the_low_watermark():
    read = [0, 0]
    log: list[str] = []
    g = _gate(read, log=log)
    g.published(_Manifest(100, 900))  # stage 1 is the full one

    def trainer() -> None:
        for r in (200, 450, 500):  # 700 unread, then 450, then 400 (< 500)
            time.sleep(0.05)
            read[1] = r

    t = threading.Thread(target=trainer)
    t.start()
    waited = g.wait()
    t.join()
    assert waited > 0.1 and g.pauses == 1 and g.unread()[1] < 0.5 * SEG
    assert "pausing capture, stage 1's segment" in log[0] and "resuming capture" in log[1]


def test_a_pause_ends_with_an_error_when_the_trainers_stopped_reading():
    g = _gate([0, 0], drained=True)
    g.published(_Manifest(0, 900))
    with pytest.raises(DataIntegrityError, match="stopped reading"):
        g.wait()


def test_a_pause_is_bounded():
    g = _gate([0, 0], max_pause_s=0.05)
    g.published(_Manifest(850, 0))
    with pytest.raises(DataIntegrityError, match=r"store\.backpressure_max_pause_s=0\.05"):
        g.wait()


def test_a_stop_ends_a_pause():
    g = _gate([0, 0])
    g.published(_Manifest(850, 0))
    stop = threading.Event()
    stop.set()
    with pytest.raises(DataIntegrityError, match="stopped while paused"):
        g.wait(stop)


def test_read_records_count_each_engines_bytes_per_stage(tmp_path):
    """LiveSource's read records are what the gate reads: per engine, per PP stage."""
    store = MemoryStore()
    prefixes = []
    want = [[0, 0], [0, 0]]
    for e in range(2):
        prefix = f"job1-e{e}"
        prefixes.append(prefix)
        w = QueueWriter(tmp_path, e, prefix)
        w.reset()
        for i in range(3):
            m = build_manifest(f"{prefix}-s{i}", [2, 5, 6], 10 + i, 16, 6, 2, "bfloat16")
            for s in range(2):
                layers = {
                    f.layer_id: torch.zeros(f.shape, dtype=torch.bfloat16)
                    for f in m.fragments
                    if f.stage == s
                }
                ids = torch.zeros(m.num_tokens, dtype=torch.int64) if s == 0 else None
                want[e][s] += fragments.publish_stage(store, m, s, layers, ids)
            w.append(m.to_json())
        w.done()
    src = LiveSource(
        "",
        expected=6,
        store_factory=lambda: store,
        retry_max_wait_s=1,
        follow=ManifestQueues(str(tmp_path), tuple(prefixes), (3, 3), stall_timeout_s=5),
        spool_dir=str(tmp_path / "spool"),
        epochs=1,
        engine_prefixes=tuple(prefixes),
    )
    for r in range(2):
        assert len(list(src(r, 2, 0, 0))) == 3
        assert list(src(r, 2, 1, 0)) == []  # one pass: nothing spooled, nothing replayed
    assert not (tmp_path / "spool" / "rank0").exists()
    for e in range(2):
        assert read_stage_bytes(tmp_path / "spool", 2, e, 2) == want[e]
        assert read_stage_bytes(tmp_path / "spool", 2, e, 2, prefixes[e]) == want[e]
        # An earlier attempt's records (another key prefix) count as nothing read.
        assert read_stage_bytes(tmp_path / "spool", 2, e, 2, f"job0-e{e}") == [0, 0]


def test_a_spool_past_its_bound_raises(tmp_path):
    store = MemoryStore()
    w = QueueWriter(tmp_path, 0, "job2-e0")
    w.reset()
    for i in range(4):
        m = build_manifest(f"job2-e0-s{i}", [2, 6], 32, 16, 6, 1, "bfloat16")
        layers = {f.layer_id: torch.zeros(f.shape, dtype=torch.bfloat16) for f in m.fragments}
        fragments.publish_stage(store, m, 0, layers, torch.zeros(32, dtype=torch.int64))
        w.append(m.to_json())
    w.done()
    src = LiveSource(
        "",
        expected=4,
        store_factory=lambda: store,
        retry_max_wait_s=1,
        follow=ManifestQueues(str(tmp_path), ("job2-e0",), (4,), stall_timeout_s=5),
        spool_dir=str(tmp_path / "spool"),
        epochs=2,
        spool_max_bytes=2 * m.nbytes,
    )
    with pytest.raises(DataIntegrityError, match=r"training\.spool_max_size"):
        list(src(0, 1, 0, 0))


# -- the real master ------------------------------------------------------------------------------

NUM = 160
TOKENS = 512


class _StandInEngine:
    """`CaptureEngine` without vLLM: each prompt becomes one sample whose fragments a real
    Mooncake writer (this process, its own segment) publishes, as a stage's TP rank 0 does."""

    backend = "stand-in"
    all_published = threading.Event()  # set once NUM samples are out; the control's trainer waits

    def __init__(self, engine_cfg: Any, target_dir: str, address: str, store_cfg: Any, run_id: str, **_: Any):
        from hpctoolkit.capture.layout import capture_ids_for
        from hpctoolkit.engine.kwargs import run_prefix
        from hpctoolkit.store.mooncake import MooncakeStore
        from hpctoolkit.targets.resolve import target_hf_config

        target = target_hf_config(target_dir)
        self.layers = int(target["num_hidden_layers"])
        self.hidden = int(target["hidden_size"])
        self.ids = capture_ids_for(engine_cfg.target_layer_ids, self.layers)
        self.prefix = run_prefix(run_id, 0)
        self.store = MooncakeStore(address, store_cfg, "writer")
        self.n = 0

    def __enter__(self) -> _StandInEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.store.close()

    def capture(self, prompts: list[list[int]], positions: Sequence[int] | None = None) -> list[Any]:
        out = []
        for ids in prompts:
            key = f"{self.prefix}-s{self.n}"
            self.n += 1
            input_ids = torch.tensor(ids, dtype=torch.int64)
            extra = {fragments.INPUT_IDS_SHA256: fragments.input_ids_digest(input_ids)}
            m = build_manifest(key, self.ids, len(ids), self.hidden, self.layers, 1, "bfloat16", extra=extra)
            layers = {f.layer_id: tensor_for(f.key, f.shape, torch.bfloat16) for f in m.fragments}
            fragments.publish_stage(self.store, m, 0, layers, input_ids)
            out.append(m)
            if self.n == NUM:
                self.all_published.set()
        return out


def _run_slow_trainer_job(tmp_path: Path, monkeypatch: Any, *, gate: bool) -> dict[str, Any]:
    """The engine leader's loop against a slow trainer on a real master; what happened."""
    from hpctoolkit.engine import engine as engine_mod
    from hpctoolkit.engine.kwargs import run_prefix
    from hpctoolkit.plan.placement import make_plan
    from hpctoolkit.recipe.couplings import store_sizing
    from hpctoolkit.recipe.load import load_recipe
    from hpctoolkit.roles import engines
    from hpctoolkit.roles.context import NodeContext
    from hpctoolkit.rundir.atomic import write_json_atomic
    from hpctoolkit.rundir.layout import RunDir
    from hpctoolkit.store.mooncake import MooncakeStore
    from hpctoolkit.store.mooncake_master import launch_master
    from hpctoolkit.store.probe import count_keys_via_master
    from hpctoolkit.targets import resolve as target_resolve

    overrides = [
        f"paths.output_dir={tmp_path}",
        f"data.num_samples={NUM}",
        "data.regenerate_tokens=0",
        f"data.max_prompt_tokens={TOKENS}",
        "engine.capture_batch=2",
        "training.steps=80",  # x batch 2: one pass over the 160 samples
        # 160 samples of 0.53 MB are 5 times the segment, 1.7 times the whole store (this writer's
        # segment and the leader's 32 MiB mask segment): they fit only if capture waits for reads.
        "store.global_segment_size=16MB",
        "store.local_buffer_size=4MB",
        "store.backpressure_high=0.5",
        "store.backpressure_low=0.25",
        # A put on a full segment fails within 2 s: had the engine not paused, the run fails.
        "store.put_retry_max_wait_seconds=2",
        "store.kv_lease_ttl_s=1",
        "store.get_retry_max_wait_seconds=10",
    ]
    cfg = load_recipe("recipes/tiny.yaml", overrides)  # the sizing at load accepts it
    plan = make_plan(cfg)
    sized = store_sizing(cfg)
    sample_bytes = sized.longest_sample_bytes
    assert NUM * sample_bytes > 2 * cfg.store.global_segment_size
    run = RunDir.of(tmp_path, "bp-run")
    run.root.mkdir(parents=True)
    ctx = NodeContext(cfg, plan, 0, ("localhost",), "localhost", None, run)
    master = launch_master(small_store_cfg(kv_lease_ttl_s=1.0), tmp_path / "master-logs")
    try:
        write_json_atomic(
            run.master_record,
            {"run_id": ctx.run_id, "address": master.address, "metrics_address": master.metrics_address},
        )
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 500, (TOKENS,), generator=g).tolist() for _ in range(NUM)]
        # (input_ids, loss_mask) per sample, as engine_prompts gives them.
        monkeypatch.setattr(engines, "engine_prompts", lambda *_: [(p, [1] * len(p)) for p in prompts])
        monkeypatch.setattr(engines, "engine_node_args", lambda *_, **__: {})
        monkeypatch.setattr(engine_mod, "CaptureEngine", _StandInEngine)
        monkeypatch.setattr(target_resolve, "resolve_target", lambda t: t)

        prefix = run_prefix(ctx.run_id, 0)
        read: list[list[int]] = []
        failures: list[BaseException] = []

        _StandInEngine.all_published.clear()

        def slow_trainer() -> None:
            if not gate:
                # The control must not depend on which of the two is faster on a loaded machine
                # (CI once had the engine publish no faster than this trainer read): its trainer
                # starts reading only once the engine has published everything or failed.
                _StandInEngine.all_published.wait(240)
            src = LiveSource(
                "",
                expected=NUM,
                store_factory=lambda: MooncakeStore(master.address, cfg.store, "reader"),
                retry_max_wait_s=10,
                follow=ManifestQueues(str(run.root), (prefix,), (NUM,), stall_timeout_s=60),
                spool_dir=str(run.spool),
                epochs=1,
                engine_prefixes=(prefix,),
            )
            try:
                for s in src(0, 1, 0, 0):
                    read.append(s.input_ids.tolist())
                    time.sleep(0.08)  # slower than the engine publishes
            except BaseException as err:
                failures.append(err)
            finally:
                write_drained(run.root, ctx.run_id)

        if not gate:
            from hpctoolkit.roles import backpressure

            real = backpressure.for_engine

            def never_pauses(*a: Any, **kw: Any) -> Backpressure:
                g = real(*a, **kw)
                g.high = float("inf")
                return g

            monkeypatch.setattr(backpressure, "for_engine", never_pauses)
        trainer = threading.Thread(target=slow_trainer, daemon=True)
        trainer.start()
        from hpctoolkit.plan.placement import Process

        engine_error = None
        try:
            engines.run_engine_leader(ctx, Process("engine-leader", 0, (0,), 0, 0))
        except Exception as err:
            engine_error = err
            _StandInEngine.all_published.set()
            write_drained(run.root, ctx.run_id)
        trainer.join(60)
        return {
            "engine_error": engine_error,
            "trainer_errors": failures,
            "read": read,
            "prompts": prompts,
            "keys_left": count_keys_via_master(master.metrics_address),
        }
    finally:
        master.stop()


@pytest.mark.real
@pytest.mark.gpu  # and in the GPU tier, on a CUDA engine
@pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake (the 'engine' extra) is not importable")
def test_engines_pause_for_a_slow_trainer_on_the_real_master(tmp_path, monkeypatch, capsys):
    got = _run_slow_trainer_job(tmp_path, monkeypatch, gate=True)
    out = capsys.readouterr().out
    assert got["engine_error"] is None and not got["trainer_errors"], got
    # No sample lost, none twice, in order, bit for bit (HiddenStateDataset checks each sha).
    assert got["read"] == got["prompts"]
    assert got["keys_left"] == 0
    assert "backpressure: pausing capture" in out and "backpressure: resuming capture" in out, out
    assert f"published {NUM}/{NUM} samples" in out


@pytest.mark.real
@pytest.mark.gpu  # and in the GPU tier, on a CUDA engine
@pytest.mark.skipif(not HAVE_MOONCAKE, reason="mooncake (the 'engine' extra) is not importable")
def test_without_the_pause_the_same_job_fails(tmp_path, monkeypatch):
    """The control: the segment cannot hold what the engine publishes ahead of the trainer.
    Here the trainer reads nothing until the engine has published every sample, so the outcome
    does not hang on relative speed under load. Mooncake spills past the writer's preferred
    segment into any other (here the leader's mask segment) and then evicts unread samples to make
    room, or refuses a put once nothing can be evicted; either way the run fails (measured: a
    sample's objects went missing)."""
    got = _run_slow_trainer_job(tmp_path, monkeypatch, gate=False)
    assert got["engine_error"] is not None or got["trainer_errors"], got
    assert len(got["read"]) < NUM
