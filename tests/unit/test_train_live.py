"""The live source as a Slurm run uses it: every engine's manifest queue, the store, a spool that
later epochs replay. On the in-memory store (the real master is exercised by test_slurm_e2e)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpctoolkit.capture.manifest import build_manifest
from hpctoolkit.capture.queue import QueueWriter
from hpctoolkit.errors import ConfigError
from hpctoolkit.recipe.schema import RecipeConfig
from hpctoolkit.store import fragments
from hpctoolkit.store.memory import MemoryStore
from hpctoolkit.train.run import train
from hpctoolkit.train.source import LiveSource, ManifestQueues, epoch_order

pytestmark = pytest.mark.timeout(180)
NUM_LAYERS = 6
ROOT = Path(__file__).resolve().parents[2]


def _publish(
    store: MemoryStore, out: Path, engines: int, per_engine: int, job: str = "job9", first: int = 0
) -> list[str]:
    g = torch.Generator().manual_seed(first)
    prefixes = []
    for e in range(engines):
        prefix = f"{job}-e{e}"
        prefixes.append(prefix)
        w = QueueWriter(out, e, prefix)
        w.reset()
        for i in range(first, first + per_engine):
            n = 20 + i
            m = build_manifest(f"{prefix}-s{i}", [2, 3, 4, NUM_LAYERS], n, 128, NUM_LAYERS, 1, "bfloat16")
            layers = {f.layer_id: torch.randn(n, 128, generator=g).to(torch.bfloat16) for f in m.fragments}
            fragments.publish_stage(store, m, 0, layers, torch.randint(0, 500, (n,), generator=g))
            w.append(m.to_json())
        w.done()
    return prefixes


def _source(store, out: Path, prefixes, expected, resumed: bool = False) -> LiveSource:
    return LiveSource(
        "",
        expected=sum(expected),
        store_factory=lambda: store,
        retry_max_wait_s=1,
        follow=ManifestQueues(str(out), tuple(prefixes), tuple(expected), stall_timeout_s=5),
        spool_dir=str(out / "spool"),
        resumed=resumed,
    )


def test_ranks_split_all_engines_samples_and_spool_them(tmp_path):
    store = MemoryStore()
    prefixes = _publish(store, tmp_path, engines=2, per_engine=3)
    src = _source(store, tmp_path, prefixes, [3, 3])
    got = {r: [s.key for s in src(r, 2, 0, 0)] for r in range(2)}
    # Round-robin over the engines, then rank r takes positions r, r+2, ...
    assert got == {
        0: ["job9-e0-s0", "job9-e0-s1", "job9-e0-s2"],
        1: ["job9-e1-s0", "job9-e1-s1", "job9-e1-s2"],
    }
    assert store.keys() == []
    for r in range(2):
        rec = json.loads(src.read_record(r).read_text())
        assert rec["samples"] == 3 and rec["complete"] and rec["bytes"] > 0
        # Replayed from the spool, in epoch 1's order, after the one sample a resume skips.
        assert [s.key for s in src(r, 2, 1, 1)] == [got[r][i] for i in epoch_order(3, 0, 1)][1:]
    with pytest.raises(ConfigError, match="cannot resume"):
        list(src(0, 2, 0, 1))


def test_a_resumed_first_pass_keeps_what_its_checkpoint_trained_and_spools_the_rest(tmp_path):
    """Attempt 1 read s0..s2 (spooled) but its checkpoint trained on s0 only; attempt 2's engine
    captures s1, s2 again under its own prefix. The spool then holds every sample once (the
    replayed epoch sees s0 of attempt 1, s1 and s2 of attempt 2), none read but untrained."""
    store = MemoryStore()
    first = _source(store, tmp_path, _publish(store, tmp_path, engines=1, per_engine=3), [3])
    assert [s.key for s in first(0, 1, 0, 0)] == ["job9-e0-s0", "job9-e0-s1", "job9-e0-s2"]
    again_prefixes = _publish(store, tmp_path, engines=1, per_engine=2, job="job9r1", first=1)
    again = _source(store, tmp_path, again_prefixes, [2], resumed=True)
    assert [s.key for s in again(0, 1, 0, 1)] == ["job9r1-e0-s1", "job9r1-e0-s2"]
    rec = json.loads(again.read_record(0).read_text())
    assert rec["samples"] == 3 and rec["complete"]
    spooled = ["job9-e0-s0", "job9r1-e0-s1", "job9r1-e0-s2"]
    assert [s.key for s in again(0, 1, 1, 0)] == [spooled[i] for i in epoch_order(3, 0, 1)]
    assert store.keys() == []


def test_each_replayed_epoch_reads_the_spool_in_its_own_order_the_same_on_every_attempt(tmp_path):
    """Epochs >= 1 are permutations of the spool drawn from (seed, epoch): no two epochs repeat
    the same batches, a second reader (a resumed attempt) sees the same order, and a resume's
    `skip` continues the epoch where it stopped."""
    store = MemoryStore()
    prefixes = _publish(store, tmp_path, engines=1, per_engine=12)
    src = _source(store, tmp_path, prefixes, [12])
    spooled = [s.key for s in src(0, 1, 0, 0)]
    epochs = {e: [s.key for s in src(0, 1, e, 0)] for e in (1, 2, 3)}
    for e, keys in epochs.items():
        assert sorted(keys) == sorted(spooled)  # every sample once
        assert keys == [spooled[i] for i in epoch_order(12, 0, e)]
    assert len({tuple(k) for k in epochs.values()} | {tuple(spooled)}) == 4  # four orders
    assert [s.key for s in src(0, 1, 2, 5)] == epochs[2][5:]  # a resume mid-epoch
    src.seed = 7  # another training seed, other orders
    assert [s.key for s in src(0, 1, 1, 0)] != epochs[1]
    assert epoch_order(5, 3, 0) == [0, 1, 2, 3, 4]  # the first pass: as captured


def test_training_longer_than_one_pass_replays_the_spool(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    store = MemoryStore()
    prefixes = _publish(store, tmp_path, engines=1, per_engine=3)
    cfg = RecipeConfig()
    cfg.paths.target_model = "builtin:tiny-qwen3"
    cfg.paths.output_dir = str(tmp_path)
    cfg.draft.config = "recipes/draft_models/tiny_dflash.json"
    t = cfg.training
    t.steps, t.batch_size, t.warmup_steps, t.checkpoint_every = 4, 2, 1, 4
    t.num_anchors, t.max_seq_len = 4, 64
    summary = train(cfg, _source(store, tmp_path, prefixes, [3]), tmp_path / "train")
    assert summary["steps_trained"] == 4
    assert store.keys() == []
    assert json.loads((tmp_path / "spool" / "read-rank0.json").read_text())["samples"] == 3
