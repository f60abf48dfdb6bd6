"""WMIX64 (`hpctoolkit.integrity.devsum`) on the host: the tensor path against the plain-integer definition,
and what it catches. Its CUDA paths (torch ops and the Triton kernel) are checked against the same
definition in tests/gpu/test_devsum_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch

from hpctoolkit.integrity import devsum

# reference_digest8 of the input in test_the_definition_is_pinned, 2026-12-06.
KNOWN = "baa09019bbc32fd5"


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 7, 8, 63, 4096, 4099])
def test_the_tensor_path_is_the_definition_at_every_length(n):
    data = random.Random(n).randbytes(n)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    assert devsum.digests8([t]) == [devsum.reference_digest8(data)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int64, torch.uint8])
def test_any_dtype_is_summed_as_its_bytes(dtype):
    t = (torch.randn(13, 24, generator=torch.Generator().manual_seed(1)) * 100).to(dtype)
    assert devsum.digests8([t]) == [devsum.reference_digest8(_bytes(t))]


def test_a_view_off_a_word_boundary_is_summed_from_its_own_bytes():
    buf = torch.arange(203, dtype=torch.int32).view(torch.uint8)
    view = buf[3:611]
    assert devsum.digests8([view]) == [devsum.reference_digest8(_bytes(view))]


def test_the_sum_does_not_depend_on_how_the_words_are_split(monkeypatch):
    t = torch.randint(0, 255, (40_003,), dtype=torch.uint8)
    whole = devsum.digests8([t])
    monkeypatch.setattr(devsum, "_CHUNK", 1000)  # many partial sums, added in another grouping
    assert devsum.digests8([t]) == whole


def test_a_flipped_bit_a_swapped_pair_and_a_cut_all_change_the_digest():
    t = torch.randint(-(2**31), 2**31 - 1, (5000,), dtype=torch.int32)
    (ref,) = devsum.digests8([t])
    for i in (0, 17, 4999):
        for bit in (0, 13, 31):
            flipped = t.clone()
            flipped[i] ^= 1 << bit if bit < 31 else -(2**31)
            assert devsum.digests8([flipped]) != [ref], (i, bit)
    swapped = t.clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert t[10] != t[11] and devsum.digests8([swapped]) != [ref]
    assert devsum.digests8([t[:-1]]) != [ref]
    zeros = torch.zeros(8, dtype=torch.uint8)
    assert devsum.digests8([zeros]) != devsum.digests8([zeros[:4]])  # the length counts


def test_the_definition_is_pinned():
    """A known answer: a change to the constants or the mix would make earlier sums unreadable."""
    data = bytes(range(256)) * 4 + b"\x01\x02\x03"
    assert devsum.reference_digest8(data).hex() == KNOWN


def test_a_tensor_that_is_not_contiguous_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        devsum.digests8([torch.zeros(4, 4).t()])
