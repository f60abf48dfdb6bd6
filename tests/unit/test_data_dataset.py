"""HiddenStateDataset: order, sharding, resume, manifest sources and rejection; offline shards."""

from __future__ import annotations

import json
import queue

import pytest
import torch
from store_fixtures import assert_sample_matches, make_manifest, publish_all

from hpctoolkit.data.dataset import HiddenStateDataset
from hpctoolkit.data.offline import ShardReader, ShardWriter, read_index, save_manifest_samples
from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(60)


def _published(n: int, prefix: str = "s") -> tuple[MemoryStore, list]:
    st = MemoryStore()
    ms = [make_manifest(f"{prefix}{i}", tokens=8 + i, hidden=16) for i in range(n)]
    for m in ms:
        publish_all(st, m)
    return st, ms


def test_yields_whole_samples_in_manifest_order_and_empties_the_store():
    st, ms = _published(4)
    got = list(HiddenStateDataset(ms, st, retry_max_wait_s=0))
    assert [s.key for s in got] == ["s0", "s1", "s2", "s3"]
    for s, m in zip(got, ms, strict=True):
        assert_sample_matches(s, m)
    assert st.keys() == []


def test_accepts_manifest_dicts_json_and_queues():
    st, ms = _published(3)
    q: queue.Queue = queue.Queue()
    q.put(ms[0].to_dict())
    q.put(ms[1].to_json())
    q.put(ms[2])
    q.put(None)
    assert [s.key for s in HiddenStateDataset(q, st, retry_max_wait_s=0)] == ["s0", "s1", "s2"]


def test_ranks_take_disjoint_deterministic_shards():
    st, ms = _published(7)
    keys = [
        [s.key for s in HiddenStateDataset(ms, st, retry_max_wait_s=0, rank=r, world_size=3, remove=False)]
        for r in range(3)
    ]
    assert keys == [["s0", "s3", "s6"], ["s1", "s4"], ["s2", "s5"]]


def test_resume_from_state_dict_continues_the_same_order():
    st, ms = _published(6)
    ds = HiddenStateDataset(ms, st, retry_max_wait_s=0, rank=1, world_size=2, remove=False)
    it = iter(ds)
    assert next(it).key == "s1"
    state = ds.state_dict()
    assert state == {"consumed": 1, "rank": 1, "world_size": 2}
    resumed = HiddenStateDataset(ms, st, retry_max_wait_s=0, rank=1, world_size=2, remove=False)
    resumed.load_state_dict(state)
    assert [s.key for s in resumed] == ["s3", "s5"]
    assert [
        s.key
        for s in HiddenStateDataset(ms, st, retry_max_wait_s=0, rank=1, world_size=2, skip=2, remove=False)
    ] == ["s5"]
    with pytest.raises(ConfigError, match="same sharding"):
        HiddenStateDataset(ms, st, retry_max_wait_s=0, rank=0, world_size=2).load_state_dict(state)
    with pytest.raises(ConfigError, match="rank"):
        HiddenStateDataset(ms, st, retry_max_wait_s=0, rank=2, world_size=2)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("num_tokens", 0, r"'bad'.*'num_tokens'"),
        ("fragments", "x", r"'bad'.*'fragments'"),
        ("schema_version", 99, r"'bad'.*'schema_version'"),
        (
            "input_ids",
            {"key": "bad_input_ids", "role": "input_ids", "stage": 0, "shape": [7], "dtype": "int64"},
            r"'bad'.*'input_ids'",
        ),
    ],
)
def test_malformed_manifest_is_rejected_naming_key_and_field(field, value, match):
    st, ms = _published(1, prefix="ok")
    bad = make_manifest("bad").to_dict()
    bad[field] = value
    it = iter(HiddenStateDataset([ms[0], bad], st, retry_max_wait_s=0))
    assert next(it).key == "ok0"
    with pytest.raises(DataIntegrityError, match=match):
        next(it)


def test_inconsistent_fragment_shape_in_manifest_is_rejected():
    st = MemoryStore()
    d = make_manifest("bad").to_dict()
    d["fragments"][1]["shape"] = [16, 33]
    with pytest.raises(DataIntegrityError, match=r"'bad'.*fragments\[1\].*shape"):
        list(HiddenStateDataset([d], st, retry_max_wait_s=0))


def test_a_missing_fragment_stops_iteration_without_a_partial_sample():
    st, ms = _published(2)
    st.remove(["s1_layer3"])
    it = iter(HiddenStateDataset(ms, st, retry_max_wait_s=0.1))
    got = [next(it).key]
    with pytest.raises(DataIntegrityError, match="s1_layer3"):
        next(it)
    assert got == ["s0"]


# -- offline shards -------------------------------------------------------------------------------


def test_shards_roundtrip_through_the_same_dataset_path(tmp_path):
    st, ms = _published(5)
    online = list(HiddenStateDataset(ms, st, retry_max_wait_s=0))
    per_sample = ms[0].nbytes
    n = save_manifest_samples(online, tmp_path, max_shard_bytes=2 * per_sample + 1)
    assert n == 5
    shards, torn = read_index(tmp_path)
    assert not torn and len(shards) >= 2
    assert [k for s in shards for k in s["samples"]] == [m.sample_key for m in ms]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left

    reader = ShardReader(tmp_path)
    replay = list(reader.dataset())
    assert [s.key for s in replay] == [m.sample_key for m in ms]
    for s, m in zip(replay, ms, strict=True):
        assert_sample_matches(s, m)
    # Replay never deletes, so a second epoch sees the same data; sharding works as online.
    assert [s.key for s in reader.dataset(rank=1, world_size=2)] == ["s1", "s3"]
    assert len(reader) == 5
    assert_sample_matches(reader[3], ms[3])  # random access, for shuffled epochs


def test_shards_are_plain_safetensors(tmp_path):
    from safetensors import safe_open

    st, ms = _published(1)
    with ShardWriter(tmp_path) as w:
        for s in HiddenStateDataset(ms, st, retry_max_wait_s=0):
            w.add(s)
    with safe_open(str(tmp_path / "shard-00000.safetensors"), "pt") as f:
        assert set(f.keys()) == {"s0_input_ids", "s0_layer1", "s0_layer3", "s0_layer4"}
        assert f.get_tensor("s0_layer3").dtype == torch.bfloat16
        manifests = json.loads(f.metadata()["hpctoolkit.manifests"])
    # The store's manifest, with every object's checksum in place of the stages' sums objects.
    want = ms[0].to_dict() | {"sums": []}
    for o in [manifests[0]["input_ids"], *manifests[0]["fragments"]]:
        assert o.pop("digest").startswith("xxh3_64:")
    assert manifests == [want]


def test_index_names_only_complete_shards_after_a_crash(tmp_path):
    st, ms = _published(3)
    samples = list(HiddenStateDataset(ms, st, retry_max_wait_s=0))
    w = ShardWriter(tmp_path, max_shard_bytes=1)  # one sample per shard
    w.add(samples[0])
    w.add(samples[1])  # closes shard 0
    # Crash here: sample 1 was pending and never written.
    assert [s["samples"] for s in read_index(tmp_path)[0]] == [["s0"]]
    assert [s.key for s in ShardReader(tmp_path).dataset()] == ["s0"]
    # A new writer appends to what is there and refuses duplicates.
    w2 = ShardWriter(tmp_path, max_shard_bytes=1)
    with pytest.raises(DataIntegrityError, match="s0"):
        w2.add(samples[0])
    w2.add(samples[2])
    w2.close()
    assert [s.key for s in ShardReader(tmp_path).dataset()] == ["s0", "s2"]


def test_a_shard_write_failing_midway_leaves_no_partial_or_temporary_file(tmp_path, monkeypatch):
    import hpctoolkit.data.offline as offline

    st, ms = _published(2)
    samples = list(HiddenStateDataset(ms, st, retry_max_wait_s=0))
    w = ShardWriter(tmp_path, max_shard_bytes=1)
    w.add(samples[0])
    w.flush()
    real = offline._write_safetensors

    def half_then_fail(path, tensors, meta):
        real(path, tensors[:1], meta)
        raise OSError("disk full")

    monkeypatch.setattr(offline, "_write_safetensors", half_then_fail)
    w.add(samples[1])
    with pytest.raises(OSError, match="disk full"):
        w.flush()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.jsonl", "shard-00000.safetensors"]
    assert [s.key for s in ShardReader(tmp_path).dataset()] == ["s0"]


def test_truncated_or_mismatched_shard_is_rejected(tmp_path):
    st, ms = _published(1)
    save_manifest_samples(HiddenStateDataset(ms, st, retry_max_wait_s=0), tmp_path)
    shard = tmp_path / "shard-00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(DataIntegrityError, match=r"s0_layer4.*truncated"):
        list(ShardReader(tmp_path).dataset())


def test_works_under_a_dataloader_without_collation():
    from torch.utils.data import DataLoader

    st, ms = _published(2)
    ds = HiddenStateDataset(ms, st, retry_max_wait_s=0)
    got = list(DataLoader(ds, batch_size=None, num_workers=0))
    assert [s.key for s in got] == ["s0", "s1"]
    got[0].release()
    got[1].release()
    assert len(ds.pool._free) == 2  # released buffers wait for the next samples
