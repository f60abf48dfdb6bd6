"""publish_stage / fetch_sample over the in-memory fake, and MooncakeStore's code paths over a fake
native client (return codes, NO_AVAILABLE_HANDLE backoff, hard pin). The real master is exercised
in test_store_mooncake.py."""

from __future__ import annotations

import sys
import time
import types
import warnings

import pytest
import torch
from store_fixtures import make_manifest, publish_all, small_store_cfg, stage_payload, tensor_for, unsummed

from hpctoolkit.errors import DataIntegrityError, StoreError
from hpctoolkit.store import fragments, mooncake
from hpctoolkit.store.api import MissingKeysError
from hpctoolkit.store.memory import MemoryStore
from hpctoolkit.store.mooncake import MooncakeStore, StoreUnavailableError

pytestmark = pytest.mark.timeout(60)


def test_publish_both_stages_then_fetch_is_bitwise_and_removes():
    st = MemoryStore()
    m = make_manifest("a")
    n0 = fragments.publish_stage(st, m, 0, *stage_payload(m, 0))
    n1 = fragments.publish_stage(st, m, 1, *stage_payload(m, 1))
    assert n0 + n1 == m.nbytes + sum(f.nbytes for f in m.sums)
    s = fragments.fetch_sample(st, m, retry_max_wait_s=0)
    assert (
        s.key == "a" and s.aux_hidden_states.shape == (2, 16, 32) and s.last_hidden_states.shape == (16, 32)
    )
    assert torch.equal(s.aux_hidden_states[1], tensor_for("a_layer3", (16, 32), torch.bfloat16))
    assert st.keys() == []


def test_sample_is_one_buffer_with_views():
    st = MemoryStore()
    m = make_manifest("v")
    publish_all(st, m)
    s = fragments.fetch_sample(st, m, retry_max_wait_s=0)
    base = s.input_ids.untyped_storage().data_ptr()
    assert s.aux_hidden_states.untyped_storage().data_ptr() == base
    assert s.last_hidden_states.untyped_storage().data_ptr() == base
    cat = s.hidden_states_cat()
    assert cat.shape == (16, 64) and torch.equal(cat[:, 32:], s.aux_hidden_states[1])
    assert cat.untyped_storage().data_ptr() != base  # a copy, as documented


@pytest.mark.parametrize(
    ("stage", "mutate", "match"),
    [
        (0, lambda L, ids: (L | {3: L[1]}, ids), r"not owned \[3\]"),
        (1, lambda L, ids: ({4: L[4]}, ids), r"missing \[3\]"),
        (0, lambda L, ids: ({1: L[1][:-1]}, ids), r"a_layer1.*shape \[15, 32\]"),
        (0, lambda L, ids: ({1: L[1].float()}, ids), r"a_layer1.*dtype float32"),
        (0, lambda L, ids: (L, None), "stage 0 must publish input_ids"),
        (0, lambda L, ids: (L, ids[:-1]), r"a_input_ids.*shape \[15\]"),
        (0, lambda L, ids: (L, ids.flip(0)), r"a_input_ids.*input_ids_sha256"),
        (1, lambda L, ids: (L, torch.zeros(16, dtype=torch.int64)), "only stage 0 publishes input_ids"),
        (2, lambda L, ids: (L, ids), r"stage 2 is outside \[0, 2\)"),
    ],
)
def test_publish_rejects_anything_but_the_stages_manifest_objects(stage, mutate, match):
    st = MemoryStore()
    m = make_manifest("a")
    layers, ids = stage_payload(m, min(stage, 1))
    if ids is None:
        ids = tensor_for(m.input_ids.key, m.input_ids.shape, torch.int64)
    layers, ids = mutate(layers, ids)
    with pytest.raises(DataIntegrityError, match=match):
        fragments.publish_stage(st, m, stage, layers, ids)
    assert st.keys() == []  # nothing written on a rejected publish


def test_writer_put_failure_raises():
    st = MemoryStore()
    m = make_manifest("f")
    st.fail_puts_for.add("f_layer1")
    with pytest.raises(StoreError, match="f_layer1"):
        fragments.publish_stage(st, m, 0, *stage_payload(m, 0))


def test_missing_fragment_raises_after_window_naming_keys_and_yields_nothing():
    st = MemoryStore()
    m = make_manifest("m")
    fragments.publish_stage(st, m, 0, *stage_payload(m, 0))
    t0 = time.monotonic()
    with pytest.raises(
        DataIntegrityError, match=r"\['m_layer3', 'm_layer4', 'm_sums1'\] still missing after 0.3s"
    ):
        fragments.fetch_sample(st, m, retry_max_wait_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2
    assert len(st.keys()) == 3  # a failed sample is left for inspection, not half-removed


def test_wrong_size_object_raises_naming_key():
    st = MemoryStore()
    m = unsummed(make_manifest("w"))  # the size check alone (a same-size change is the checksum's)
    fragments.publish_stage(st, m, 0, *stage_payload(m, 0))
    layers, _ = stage_payload(m, 1)
    st.put_many([("w_layer3", layers[3][:-1].contiguous()), ("w_layer4", layers[4])])
    with pytest.raises(DataIntegrityError, match="w_layer3"):
        fragments.fetch_sample(st, m, retry_max_wait_s=0)


def test_wrong_input_ids_raise_naming_key():
    st = MemoryStore()
    m = unsummed(make_manifest("i"))  # the ids checks alone (the checksum would refuse first)
    fragments.publish_stage(st, m, 1, *stage_payload(m, 1))
    layers, _ = stage_payload(m, 0)
    st.put_many([("i_input_ids", torch.arange(16)), ("i_layer1", layers[1])])
    with pytest.raises(DataIntegrityError, match=r"i_input_ids.*input_ids_sha256"):
        fragments.fetch_sample(st, m, retry_max_wait_s=0)
    m2 = unsummed(make_manifest("j", sha=False))
    publish_all(st, m2)
    with pytest.raises(DataIntegrityError, match=r"j_input_ids.*expected"):
        fragments.fetch_sample(st, m2, retry_max_wait_s=0, expected_input_ids=torch.arange(16))
    m3 = unsummed(make_manifest("k", sha=False))
    fragments.publish_stage(st, m3, 1, *stage_payload(m3, 1))
    st.put_many([("k_input_ids", torch.full((16,), -5)), ("k_layer1", stage_payload(m3, 0)[0][1])])
    with pytest.raises(DataIntegrityError, match=r"k_input_ids.*negative"):
        fragments.fetch_sample(st, m3, retry_max_wait_s=0)


def test_released_buffers_are_reused_and_unreleased_are_not():
    from hpctoolkit.data.sample import BufferPool

    st = MemoryStore()
    ms = [make_manifest(f"r{i}") for i in range(3)]
    for m in ms:
        publish_all(st, m)
    pool = BufferPool(1)
    a = fragments.fetch_sample(st, ms[0], retry_max_wait_s=0, pool=pool)
    ptr = a.input_ids.data_ptr()
    b = fragments.fetch_sample(st, ms[1], retry_max_wait_s=0, pool=pool)
    assert b.input_ids.data_ptr() != ptr  # a is still held
    a.release()
    c = fragments.fetch_sample(st, ms[2], retry_max_wait_s=0, pool=pool)
    assert c.input_ids.data_ptr() == ptr and c.key == "r2"
    assert torch.equal(c.last_hidden_states, tensor_for("r2_layer4", (16, 32), torch.bfloat16))
    assert torch.equal(b.last_hidden_states, tensor_for("r1_layer4", (16, 32), torch.bfloat16))


def test_failed_fetch_returns_its_buffer_to_the_pool():
    from hpctoolkit.data.sample import BufferPool

    st = MemoryStore()
    m = make_manifest("gone")
    pool = BufferPool(1)
    with pytest.raises(DataIntegrityError):
        fragments.fetch_sample(st, m, retry_max_wait_s=0, pool=pool)
    assert len(pool._free) == 1


def test_input_ids_digest_is_dtype_and_layout_independent():
    ids = torch.arange(10)
    assert fragments.input_ids_digest(ids) == fragments.input_ids_digest(ids.to(torch.int32))
    assert fragments.input_ids_digest(ids) == fragments.input_ids_digest(ids.view(2, 5).t().t())
    assert fragments.input_ids_digest(ids) != fragments.input_ids_digest(ids.flip(0))


# -- MooncakeStore over a fake native client ------------------------------------------------------


class FakeReplicateConfig:
    def __init__(self) -> None:
        self.replica_num = 0
        self.with_hard_pin = False


class FakeClient:
    """Just enough of MooncakeDistributedStore to drive MooncakeStore's code paths."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.put_codes: list[list[int]] = []  # scripted batch_put_from results, consumed in order
        self.get_code: int | None = None
        self.registered: list[tuple[int, int]] = []
        self.configs: list[object] = []

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        return 0

    def batch_is_exist(self, keys):
        return [1 if k in self.objects else 0 for k in keys]

    def batch_put_from(self, keys, ptrs, sizes, cfg):
        self.configs.append(cfg)
        codes = self.put_codes.pop(0) if self.put_codes else [0] * len(keys)
        for k, p, n, c in zip(keys, ptrs, sizes, codes, strict=True):
            if c == 0:
                self.objects[k] = _read(p, n)
        return codes

    def batch_get_into(self, keys, ptrs, sizes):
        out = []
        for k, p, n in zip(keys, ptrs, sizes, strict=True):
            if self.get_code is not None:
                out.append(self.get_code)
            elif k not in self.objects:
                out.append(-704)
            elif len(self.objects[k]) > n:
                out.append(-600)
            else:
                _write(p, self.objects[k])
                out.append(len(self.objects[k]))
        return out

    def batch_remove(self, keys, force):
        assert force
        return [0 if self.objects.pop(k, None) is not None else -704 for k in keys]

    def close(self) -> int:
        return 0


def _read(ptr: int, n: int) -> bytes:
    import ctypes

    return ctypes.string_at(ptr, n)


def _write(ptr: int, data: bytes) -> None:
    import ctypes

    ctypes.memmove(ptr, data, len(data))


@pytest.fixture
def fake_store(monkeypatch):
    monkeypatch.setattr(mooncake, "_hard_pin_warned", False)
    fake_mod = types.ModuleType("mooncake.store")
    fake_mod.ReplicateConfig = FakeReplicateConfig  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mooncake.store", fake_mod)

    def make(**cfg):
        s = MooncakeStore("127.0.0.1:1", small_store_cfg(**cfg), role="writer")
        mooncake._start_closer()  # as `_client()` does when it creates a native client
        s._store = FakeClient()
        s._replicate = s._make_replicate_config()
        return s

    return make


def test_mooncake_store_roundtrip_and_return_codes(fake_store):
    s = fake_store()
    m = make_manifest("mc")
    publish_all(s, m)
    sample = fragments.fetch_sample(s, m, retry_max_wait_s=0)
    assert torch.equal(sample.last_hidden_states, tensor_for("mc_layer4", (16, 32), torch.bfloat16))
    assert s._store.objects == {}
    # One registration per sample buffer, not one per view.
    assert s._store.registered[-1][1] == m.nbytes + sum(f.nbytes for f in m.sums)
    with pytest.raises(MissingKeysError):
        s.get_into(["nope"], [torch.empty(4)])
    s.put_many([("big", torch.zeros(8))])
    with pytest.raises(StoreError, match=r"'big' is larger"):
        s.get_into(["big"], [torch.empty(4)])
    with pytest.raises(StoreError, match=r"'big' holds 32 bytes, destination expects 64"):
        s.get_into(["big"], [torch.empty(16)])
    s._store.get_code = -900
    with pytest.raises(StoreUnavailableError, match=r"'big'.*RPC_FAIL"):
        s.get_into(["big"], [torch.empty(8)])
    s._store.put_codes = [[-800]]
    with pytest.raises(StoreError, match=r"'x'.*-800 \(TRANSFER_FAIL\)"):
        s.put_many([("x", torch.zeros(2))])
    s.remove(["big", "never-there"])  # not found counts as removed


def test_no_available_handle_is_retried_with_backoff_then_raises(fake_store):
    s = fake_store(put_retry_max_wait_seconds=5)
    s._store.put_codes = [[0, -200], [-200], [0]]
    s.put_many([("a", torch.zeros(2)), ("b", torch.ones(2))])
    assert set(s._store.objects) == {"a", "b"}
    s = fake_store(put_retry_max_wait_seconds=0.3)
    s._store.put_codes = [[-200]] * 100
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"'c'.*NO_AVAILABLE_HANDLE.*segment is full"):
        s.put_many([("c", torch.zeros(2))])
    assert time.monotonic() - t0 < 2


def test_hard_pin_is_set_when_enabled(fake_store):
    s = fake_store(enable_hard_pin=True)
    assert s._replicate.with_hard_pin is True and s._replicate.replica_num == 1
    assert fake_store()._replicate.with_hard_pin is False


def test_hard_pin_missing_in_mooncake_warns_once_and_goes_on(fake_store, monkeypatch):
    class OldReplicateConfig:
        replica_num = 0

    monkeypatch.setattr(sys.modules["mooncake.store"], "ReplicateConfig", OldReplicateConfig)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s1 = fake_store(enable_hard_pin=True)
        fake_store(enable_hard_pin=True)
    assert len([w for w in caught if "with_hard_pin" in str(w.message)]) == 1
    s1.put_many([("p", torch.zeros(2))])  # the run goes on, unpinned
    assert "p" in s1._store.objects


def test_close_is_bounded_when_native_close_blocks(fake_store):
    s = fake_store()
    s._store.close = lambda: time.sleep(30)
    t0 = time.monotonic()
    s.close(timeout_s=0.2)
    assert time.monotonic() - t0 < 2
    with pytest.raises(StoreError, match="closed"):
        s.put_many([("z", torch.zeros(1))])


def test_mooncake_module_is_not_imported_by_the_package():
    code = "import sys, hpctoolkit.store, hpctoolkit.data.dataset; print('mooncake' in sys.modules)"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


# -- the loss mask object ----------------------------------------------------------------------


def _masked(key: str):
    from hpctoolkit.capture.manifest import with_loss_mask
    from hpctoolkit.integrity.checksum import tensor_digest

    mask = (torch.arange(16) % 3 != 0).to(torch.uint8)
    return with_loss_mask(make_manifest(key), tensor_digest(mask)), mask


def _spooled_masked(key: str, out_dir):
    """A masked sample published, fetched and spooled to `out_dir`; its mask."""
    from hpctoolkit.data.offline import ShardWriter

    st = MemoryStore()
    m, mask = _masked(key)
    publish_all(st, m)
    fragments.publish_loss_mask(st, m, mask)
    with ShardWriter(out_dir) as w:
        w.add(fragments.fetch_sample(st, m, retry_max_wait_s=0))
    return mask


def test_loss_mask_travels_with_the_sample_through_the_store_and_is_removed():
    st = MemoryStore()
    m, mask = _masked("m")
    publish_all(st, m)
    assert fragments.publish_loss_mask(st, m, mask) == m.num_tokens
    s = fragments.fetch_sample(st, m, retry_max_wait_s=0)
    assert s.loss_mask is not None and torch.equal(s.loss_mask, mask)
    assert s.loss_mask.untyped_storage().data_ptr() == s.input_ids.untyped_storage().data_ptr()
    assert st.keys() == []


def test_a_missing_loss_mask_object_is_named():
    st = MemoryStore()
    m, _ = _masked("n")
    publish_all(st, m)
    with pytest.raises(DataIntegrityError, match=r"objects \['n_loss_mask'\] still missing"):
        fragments.fetch_sample(st, m, retry_max_wait_s=0)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (torch.ones(15, dtype=torch.uint8), r"p_loss_mask.*shape \[15\]"),
        (torch.full((16,), 2, dtype=torch.int64), "other than 0 and 1"),
        (torch.ones(16), "float loss_mask"),
    ],
)
def test_publish_loss_mask_refuses_a_wrong_mask(bad, match):
    m, _ = _masked("p")
    with pytest.raises(DataIntegrityError, match=match):
        fragments.publish_loss_mask(MemoryStore(), m, bad)


def test_publish_loss_mask_needs_the_manifest_to_name_it():
    with pytest.raises(DataIntegrityError, match="names no loss_mask"):
        fragments.publish_loss_mask(MemoryStore(), make_manifest("q"), torch.ones(16, dtype=torch.uint8))


def test_a_corrupted_mask_in_the_store_is_refused_on_fetch():
    st = MemoryStore()
    m, _ = _masked("r")
    publish_all(st, m)
    st.put_many([("r_loss_mask", torch.full((16,), 7, dtype=torch.uint8))])
    with pytest.raises(DataIntegrityError, match=r"r_loss_mask.*do not match the manifest's checksum"):
        fragments.fetch_sample(st, m, retry_max_wait_s=0)


def test_loss_mask_is_a_tensor_in_offline_shards(tmp_path):
    from hpctoolkit.data.offline import ShardReader

    mask = _spooled_masked("s", tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "shard-00000.safetensors"), "pt") as f:
        assert torch.equal(f.get_tensor("s_loss_mask"), mask)
    back = ShardReader(tmp_path)[0]
    assert back.loss_mask is not None and torch.equal(back.loss_mask, mask)


# -- checksums -------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["c_input_ids", "c_layer1", "c_layer3", "c_layer4", "c_loss_mask"])
def test_one_corrupted_byte_in_the_store_is_refused_naming_the_key(key):
    """Same size, one bit: what a size check cannot see. The sample is never returned, and it is
    left in the store for inspection."""
    st = MemoryStore()
    m, mask = _masked("c")
    publish_all(st, m)
    fragments.publish_loss_mask(st, m, mask)
    raw = bytearray(st._objects[key])
    raw[len(raw) // 2] ^= 0x01
    st._objects[key] = bytes(raw)
    with pytest.raises(DataIntegrityError, match=rf"sample 'c', object '{key}': its bytes do not match"):
        fragments.fetch_sample(st, m, retry_max_wait_s=0)
    left = st.keys()
    assert key in left and len(left) == len(m.all_objects)


def test_a_corrupted_sums_object_is_refused_too():
    st = MemoryStore()
    m = make_manifest("d")
    publish_all(st, m)
    raw = bytearray(st._objects["d_sums1"])
    raw[0] ^= 0x80
    st._objects["d_sums1"] = bytes(raw)
    with pytest.raises(DataIntegrityError, match=r"object 'd_layer3'.*stage 1 published \('d_sums1'\)"):
        fragments.fetch_sample(st, m, retry_max_wait_s=0)


def test_the_stage_puts_its_sums_with_its_fragments():
    st = MemoryStore()
    m = make_manifest("e")
    fragments.publish_stage(st, m, 1, *stage_payload(m, 1))
    assert sorted(st.keys()) == ["e_layer3", "e_layer4", "e_sums1"]
    assert len(st._objects["e_sums1"]) == 16


def test_a_failed_fetch_waits_for_its_hashing_threads_before_the_buffer_goes_back(monkeypatch):
    """The hashing threads read the sample's buffer: a fetch whose first object fails its check
    returns the buffer to the pool only once every thread is done with it."""
    from hpctoolkit.data.sample import BufferPool
    from hpctoolkit.integrity import checksum

    futures = []
    slow = checksum.tensor_digest8

    def recorded(tensors):  # type: ignore[no-untyped-def]
        out = [checksum._hash_pool().submit(lambda t=t: (time.sleep(0.05), slow(t))[1]) for t in tensors]
        futures.extend(out)
        return out

    monkeypatch.setattr(checksum, "digests8_async", recorded)
    st = MemoryStore()
    m = make_manifest("f", tokens=512, hidden=1024)
    publish_all(st, m)
    futures.clear()  # the writer's
    raw = bytearray(st._objects["f_input_ids"])
    raw[0] ^= 1
    st._objects["f_input_ids"] = bytes(raw)
    given_back_when_done = []

    class Pool(BufferPool):
        def give(self, buf):  # type: ignore[no-untyped-def]
            given_back_when_done.append(all(f.done() for f in futures))
            super().give(buf)

    with pytest.raises(DataIntegrityError, match=r"'f_input_ids': its bytes do not match"):
        fragments.fetch_sample(st, m, retry_max_wait_s=0, pool=Pool(1))
    assert len(futures) == 4 and given_back_when_done == [True]


def test_a_schema_1_sample_is_read_with_sizes_only():
    st = MemoryStore()
    m = unsummed(make_manifest("o"))
    publish_all(st, m)
    assert sorted(st.keys()) == ["o_input_ids", "o_layer1", "o_layer3", "o_layer4"]
    s = fragments.fetch_sample(st, m, retry_max_wait_s=0)
    assert torch.equal(s.last_hidden_states, tensor_for("o_layer4", (16, 32), torch.bfloat16))


def test_a_corrupted_byte_in_a_spool_shard_is_refused_naming_the_object_and_shard(tmp_path):
    from hpctoolkit.data.offline import ShardReader

    _spooled_masked("t", tmp_path)
    shard = tmp_path / "shard-00000.safetensors"
    saved = ShardReader(tmp_path).manifests()[0]
    assert saved["schema_version"] == 2 and saved["sums"] == []
    assert all(o["digest"].startswith("xxh3_64:") for o in [saved["input_ids"], *saved["fragments"]])
    data = bytearray(shard.read_bytes())
    data[-40] ^= 0x04  # inside the last objects' bytes (the mask is last: 16 bytes)
    shard.write_bytes(bytes(data))
    with pytest.raises(
        DataIntegrityError, match=rf"object 't_layer4' in shard {shard}: its bytes do not match"
    ):
        ShardReader(tmp_path)[0]


@pytest.mark.parametrize("schema", [2, 1])
def test_a_shard_records_the_digest_of_each_object(tmp_path, schema):
    """Hashed at spooling, all objects at once: the XXH3-64 of each object's bytes as written."""
    from hpctoolkit.data.offline import ShardReader, ShardWriter
    from hpctoolkit.integrity import checksum

    st = MemoryStore()
    m = make_manifest(f"r{schema}") if schema == 2 else unsummed(make_manifest("r1"))
    publish_all(st, m)
    sample = fragments.fetch_sample(st, m, retry_max_wait_s=0)
    with ShardWriter(tmp_path) as w:
        w.add(sample)
    saved = ShardReader(tmp_path).manifests()[0]
    views = dict(sample.destinations())
    for spec in [saved["input_ids"], *saved["fragments"]]:
        assert spec["digest"] == checksum.tensor_digest(views[spec["key"]])


def test_a_replayed_shard_hashes_each_object_once(tmp_path, monkeypatch):
    """The shard's `get_into` checks each object against the digest saved with it; `fetch_sample`
    does not hash the same bytes again against the manifest's copy of those digests."""
    from hpctoolkit.data.offline import ShardReader
    from hpctoolkit.integrity import checksum

    _spooled_masked("h", tmp_path)
    hashed: list[int] = []
    real8, real = checksum.tensor_digest8, checksum.digest

    def counting8(t):
        hashed.append(t.numel() * t.element_size())
        return real8(t)

    def counting(*buffers):
        hashed.append(sum(memoryview(b).nbytes for b in buffers))
        return real(*buffers)

    monkeypatch.setattr(checksum, "tensor_digest8", counting8)
    monkeypatch.setattr(checksum, "digest", counting)
    back = ShardReader(tmp_path)[0]
    assert sorted(hashed) == sorted(t.numel() * t.element_size() for _, t in back.destinations())


@pytest.mark.parametrize("schema", [2, 1])
def test_spooling_a_fetched_sample_reuses_the_readers_digests(tmp_path, monkeypatch, schema):
    """A sample the reader checked is spooled with the digests it computed, its bytes not hashed
    again; one read through a schema-1 manifest (sizes only) is hashed at spooling."""
    from hpctoolkit.data.offline import ShardReader, ShardWriter
    from hpctoolkit.integrity import checksum

    st = MemoryStore()
    m = make_manifest(f"u{schema}") if schema == 2 else unsummed(make_manifest("u1"))
    publish_all(st, m)
    sample = fragments.fetch_sample(st, m, retry_max_wait_s=0)
    hashed: list[int] = []
    real8 = checksum.tensor_digest8

    def counting8(t):
        hashed.append(t.numel())
        return real8(t)

    monkeypatch.setattr(checksum, "tensor_digest8", counting8)
    with ShardWriter(tmp_path) as w:
        w.add(sample)
    assert len(hashed) == (0 if schema == 2 else len(m.data_objects))
    monkeypatch.undo()
    saved = ShardReader(tmp_path).manifests()[0]
    views = dict(sample.destinations())
    for spec in [saved["input_ids"], *saved["fragments"]]:
        assert spec["digest"] == checksum.tensor_digest(views[spec["key"]])


def test_host_copies_pass_host_tensors_through_contiguous():
    """`host_copies` on the host: a contiguous tensor is returned as it is (no copy), a strided one
    as a contiguous copy with the same values (GPU tensors: tests/gpu/test_publish_gpu.py)."""
    a = torch.arange(12, dtype=torch.int64)
    b = torch.arange(12, dtype=torch.float32).view(3, 4).t()
    got = fragments.host_copies([a, b])
    assert got[0].data_ptr() == a.data_ptr()
    assert got[1].is_contiguous() and torch.equal(got[1], b)
    assert fragments.host_copies([]) == []
