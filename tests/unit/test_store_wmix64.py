"""The fragment path with WMIX64 sums (a CUDA engine's, `hpctoolkit.integrity.devsum`), on the host: the
manifest names the algorithm, a stage uses the checksums it is given, the reader checks every
summed object and refuses a changed byte naming its key; a sample checked on a device is
collated from that copy. tests/gpu/test_devsum_gpu.py runs the same on CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from store_fixtures import assert_sample_matches, make_manifest, stage_payload, tensor_for

from hpctoolkit.capture.manifest import Manifest
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.integrity import devsum
from hpctoolkit.store import fragments
from hpctoolkit.store.memory import MemoryStore
from hpctoolkit.train.batch import collate

pytestmark = pytest.mark.timeout(60)


def wmix(key: str) -> Manifest:
    return dataclasses.replace(make_manifest(key), sums_algorithm=devsum.ALGORITHM)


def publish(st: MemoryStore, m: Manifest, digests: dict[int, bytes] | None = None) -> None:
    for stage in range(m.pp_size):
        layers, ids = stage_payload(m, stage)
        mine = None if digests is None else {k: d for k, d in digests.items() if k in layers}
        fragments.publish_stage(st, m, stage, layers, ids, mine)


def test_the_manifest_names_its_sums_algorithm_and_refuses_an_unknown_one():
    m = wmix("n")
    d = m.to_dict()
    assert d["sums_algorithm"] == "wmix64" and Manifest.from_dict(d) == m
    legacy = make_manifest("o").to_dict()
    del legacy["sums_algorithm"]  # written before 2026-12-06
    assert Manifest.from_dict(legacy).sums_algorithm == "xxh3_64"
    with pytest.raises(DataIntegrityError, match=r"sample 'n'.*'sums_algorithm' is 'crc'"):
        Manifest.from_dict(d | {"sums_algorithm": "crc"})


def test_a_wmix64_sample_round_trips_and_its_stages_hold_wmix64_sums():
    st = MemoryStore()
    m = wmix("w")
    publish(st, m)
    for stage in range(m.pp_size):
        objects = [
            tensor_for(f.key, f.shape, torch.int64 if f.role == "input_ids" else torch.bfloat16)
            for f in m.summed(stage)
        ]
        assert st._objects[m.sums[stage].key] == b"".join(devsum.digests8(objects))
    s = fragments.fetch_sample(st, m, retry_max_wait_s=0)
    assert_sample_matches(s, m)
    assert s.device_copy is None  # checked on the host
    assert st.keys() == []


def test_a_stage_puts_the_checksums_it_is_given():
    """The engine sums its rows on the GPU and hands the digests over: they are what is put, so
    a wrong one (here, on purpose) is refused by the reader, naming the object."""
    st = MemoryStore()
    m = wmix("g")
    publish(st, m, digests={3: b"\0" * 8})
    with pytest.raises(
        DataIntegrityError, match=r"'g_layer3': its bytes do not match the wmix64 checksum stage 1"
    ):
        fragments.fetch_sample(st, m, retry_max_wait_s=0)
    assert "g_layer3" in st._objects  # a refused sample is left for inspection


def test_wmix64_digests_for_an_xxh3_manifest_are_refused():
    layers, ids = stage_payload(make_manifest("x"), 0)
    with pytest.raises(
        DataIntegrityError, match="given wmix64 digests for a manifest whose sums are xxh3_64"
    ):
        fragments.publish_stage(MemoryStore(), make_manifest("x"), 0, layers, ids, {1: b"\0" * 8})


@pytest.mark.parametrize("victim", ["c_input_ids", "c_layer1", "c_layer4", "c_sums0"])
def test_one_changed_byte_is_refused_naming_the_object(victim):
    st = MemoryStore()
    m = wmix("c")
    publish(st, m)
    raw = bytearray(st._objects[victim])
    raw[len(raw) // 2] ^= 0x10
    st._objects[victim] = bytes(raw)
    named = "c_layer1" if victim == "c_sums0" else victim  # the middle byte: layer1's sum
    with pytest.raises(DataIntegrityError, match=rf"sample 'c', object '{named}': its bytes do not match"):
        fragments.fetch_sample(st, m, retry_max_wait_s=0)


def test_collate_takes_the_hidden_states_from_the_checked_device_copies():
    st = MemoryStore()
    samples = []
    for key in ("d0", "d1"):
        m = wmix(key)
        publish(st, m)
        samples.append(fragments.fetch_sample(st, m, retry_max_wait_s=0))
    plain = collate(samples, max_seq_len=64, min_loss_tokens=1)
    for s in samples:  # a stand-in for the GPU copy: the same views over another buffer
        s.device_copy = s.copy_to(torch.device("cpu"))
        s.device_copy.aux_hidden_states.add_(1)
    moved = collate(samples, max_seq_len=64, min_loss_tokens=1)
    assert torch.equal(moved.context_BSC[0, :16, :32], plain.context_BSC[0, :16, :32] + 1)
    assert torch.equal(moved.last_BSH, plain.last_BSH) and torch.equal(moved.input_ids_BS, plain.input_ids_BS)
