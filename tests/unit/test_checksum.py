"""`hpctoolkit.integrity.checksum`'s parallel digests equal the serial ones, in order, and fail as they do."""

import pytest
import torch

from hpctoolkit.integrity import checksum


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [
        torch.randn(257, 33, generator=g).to(torch.bfloat16),
        torch.randint(0, 1000, (91,), generator=g),
        torch.zeros(0, dtype=torch.uint8),
        torch.randn(4096, 64, generator=g),
        torch.ones(3, dtype=torch.uint8),
    ]


def test_parallel_digests_equal_the_serial_ones_in_order():
    ts = _tensors()
    assert checksum.digests8(ts) == [checksum.tensor_digest8(t) for t in ts]
    assert [f.result() for f in checksum.digests8_async(ts)] == [checksum.tensor_digest8(t) for t in ts]


def test_no_tensors_and_one_tensor():
    assert checksum.digests8([]) == []
    assert [f.result() for f in checksum.digests8_async([])] == []
    t = _tensors()[0]
    assert checksum.digests8([t]) == [checksum.tensor_digest8(t)]


def test_a_digest8_is_the_text_digest_little_endian():
    t = _tensors()[3]
    assert checksum.digest8_text(checksum.digests8([t, t])[1]) == checksum.tensor_digest(t)


def test_a_failing_digest_reaches_the_caller():
    with pytest.raises((TypeError, AttributeError, RuntimeError)):
        [f.result() for f in checksum.digests8_async([_tensors()[0], "not a tensor"])]
