"""WMIX64 on CUDA: the Triton kernel and torch's ops on the GPU against the definition, and the
fragment path of a CUDA engine and a CUDA trainer end to end (vLLM-free).

    python -m pytest -m gpu tests/gpu/test_devsum_gpu.py -q        # on a CUDA machine

A stage gathers its rows from a cache on the GPU and sums them there before its copy to the host
(`StageRows.publish`); the reader copies the sample to its GPU, checks every stage's sums there
and keeps the checked copy, which the collate reads; one changed byte in the store is refused
naming its object.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from hpctoolkit.capture import build_manifest, owned_layers
from hpctoolkit.engine.publish import StageRows
from hpctoolkit.engine.rows import head_index_of, stage_heads
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.integrity import devsum
from hpctoolkit.store import fragments
from hpctoolkit.store.memory import MemoryStore
from hpctoolkit.train.batch import collate
from hpctoolkit.train.step import DeviceFeeder

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = [pytest.mark.gpu, needs_cuda]

CAPTURE_IDS, NUM_LAYERS, HIDDEN, BLOCK = [1, 3, 4], 4, 256, 16


@pytest.mark.parametrize("n", [1, 3, 4, 4097, 16384 * 4 + 6, 3 << 20])
@pytest.mark.parametrize("triton", [True, False])
def test_the_gpu_sums_are_the_definition(n, triton, monkeypatch):
    if not triton:
        monkeypatch.setattr(devsum, "_kernel", False)  # torch's ops on the GPU
    data = random.Random(n).randbytes(n)
    host = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    want = devsum.reference_digest8(data) if n < 100_000 else devsum.digests8([host])[0]
    assert devsum.digests8([host.cuda()]) == [want]


def test_the_kernel_agrees_with_the_host_on_a_sample_sized_tensor():
    t = torch.randn(4096, 7168, dtype=torch.bfloat16, device="cuda")
    assert devsum.digests8([t]) == devsum.digests8([t.cpu()])


def _stage_rows(stage: int) -> StageRows:
    """Stage `stage`'s cache-only layer on the GPU (the PP patch's layout: its own ids first)."""
    owned = owned_layers(CAPTURE_IDS, NUM_LAYERS, stage, 2)
    padded = stage_heads(CAPTURE_IDS, NUM_LAYERS, 2)
    g = torch.Generator(device="cuda").manual_seed(stage)
    kv = torch.randn(8, padded, BLOCK, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    return StageRows(kv, BLOCK, head_index_of(CAPTURE_IDS, owned, padded, padded), stage)


def _published(key: str, num_tokens: int = 37):
    m = build_manifest(
        key, CAPTURE_IDS, num_tokens, HIDDEN, NUM_LAYERS, 2, "bfloat16", sums_algorithm=devsum.ALGORITHM
    )
    st = MemoryStore()
    block_ids = [5, 2, 7]
    for stage in (0, 1):
        rows = _stage_rows(stage)
        rows.publish(st, m, block_ids, range(num_tokens), rows.ready())
    return st, m


def test_a_cuda_engine_and_a_cuda_reader_check_every_object_on_the_gpu():
    st, m = _published("e2e")
    host_checked = fragments.fetch_sample(st, m, retry_max_wait_s=0, remove=False)
    s = fragments.fetch_sample(st, m, retry_max_wait_s=0, device=torch.device("cuda"))
    copy = s.device_copy
    assert copy is not None and copy.aux_hidden_states.is_cuda and host_checked.device_copy is None
    assert torch.equal(copy.aux_hidden_states.cpu(), host_checked.aux_hidden_states)
    assert torch.equal(copy.last_hidden_states.cpu(), s.last_hidden_states)
    assert torch.equal(s.input_ids, torch.arange(37))
    assert st.keys() == []


def test_a_changed_byte_is_refused_on_the_gpu_naming_the_object():
    st, m = _published("bad")
    raw = bytearray(st._objects["bad_layer3"])
    raw[1001] ^= 0x01
    st._objects["bad_layer3"] = bytes(raw)
    with pytest.raises(DataIntegrityError, match=r"'bad_layer3': its bytes do not match the wmix64 checksum"):
        fragments.fetch_sample(st, m, retry_max_wait_s=0, device=torch.device("cuda"))


def test_collating_from_the_gpu_copies_is_bitwise_the_host_collate():
    samples, plain = [], []
    for i, n in enumerate((37, 20)):
        st, m = _published(f"c{i}", n)
        plain.append(fragments.fetch_sample(st, m, retry_max_wait_s=0, remove=False))
        samples.append(fragments.fetch_sample(st, m, retry_max_wait_s=0, device=torch.device("cuda")))
    want = collate(plain, max_seq_len=64, min_loss_tokens=1, pin_memory=True)
    got = collate(samples, max_seq_len=64, min_loss_tokens=1, pin_memory=True)
    assert got.context_BSC.is_cuda and not got.input_ids_BS.is_cuda  # the small tensors stay on the host
    feeder = DeviceFeeder(torch.device("cuda"), torch.float32)
    a, b = feeder.put(want), feeder.put(got)
    torch.cuda.synchronize()
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
