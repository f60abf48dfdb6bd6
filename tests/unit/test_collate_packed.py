"""A batch collated packed (`collate(pack=True)`: each sample's real rows once, padded where it is
moved) is bitwise the batch padded on the host, whatever the lengths, the cut and the dtype; until
it is moved, its padded hidden states cannot be read."""

from __future__ import annotations

import dataclasses
import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from hpctoolkit.train.batch import collate


def _sample(i: int, n: int, n_aux: int = 3, hidden: int = 8, dtype=torch.bfloat16) -> SimpleNamespace:
    g = torch.Generator().manual_seed(1000 + i)
    return SimpleNamespace(
        key=f"s{i}",
        input_ids=torch.randint(0, 50, (n,), generator=g),
        aux_hidden_states=torch.randn(n_aux, n, hidden, generator=g).to(dtype),
        last_hidden_states=torch.randn(n, hidden, generator=g).to(dtype),
        loss_mask=(torch.rand(n, generator=g) > 0.3).long(),
        manifest=None,
    )


def _same(a, b) -> None:
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, f.name
            assert torch.equal(x, y), f.name


def _cases():
    rng = random.Random(7)
    shapes = [[rng.randint(1, 40) for _ in range(rng.randint(1, 6))] for _ in range(12)] + [[1], [40, 1, 40]]
    return list(itertools.product(shapes, [1, 7, 48], [1, 16], [None, torch.float32]))


@pytest.mark.parametrize(("lengths", "max_seq_len", "step", "dtype"), _cases())
def test_packed_then_padded_is_bitwise_padded_on_the_host(lengths, max_seq_len, step, dtype):
    samples = [_sample(i, n) for i, n in enumerate(lengths)]
    kw = {"max_seq_len": max_seq_len, "min_loss_tokens": 2, "step": step}
    padded = collate(samples, pack=False, **kw)
    packed = collate(samples, pack=True, **kw)
    assert packed.packed is not None and packed.context_BSC.is_meta and packed.last_BSH.is_meta
    assert packed.packed.aux_LTH.shape[1] == sum(min(n, max_seq_len) for n in lengths)  # real rows only
    _same(padded.to("cpu", dtype), packed.to("cpu", dtype))
    # The small tensors are the host's own, at once.
    for name in ("input_ids_BS", "valid_BS", "lengths_B", "weight_B", "supervised"):
        assert torch.equal(getattr(padded, name), getattr(packed, name)), name


def test_a_packed_batchs_padded_states_cannot_be_read_before_it_is_moved():
    batch = collate([_sample(0, 5), _sample(1, 3)], max_seq_len=8, min_loss_tokens=1, pack=True)
    assert batch.context_BSC.shape == (2, 5, 24) and batch.last_BSH.shape == (2, 5, 8)
    with pytest.raises((NotImplementedError, RuntimeError)):
        batch.context_BSC.sum().item()


def test_a_cpu_trainer_collates_padded_and_a_cuda_one_packed_by_default():
    samples = [_sample(0, 5), _sample(1, 3)]
    assert collate(samples, max_seq_len=8, min_loss_tokens=1).packed is None
    if torch.cuda.is_available():
        assert collate(samples, max_seq_len=8, min_loss_tokens=1, pin_memory=True).packed is not None


def test_samples_with_device_copies_are_not_packed():
    samples = [_sample(0, 5), _sample(1, 3)]
    for s in samples:
        s.device_copy = SimpleNamespace(
            aux_hidden_states=s.aux_hidden_states, last_hidden_states=s.last_hidden_states
        )
    batch = collate(samples, max_seq_len=8, min_loss_tokens=1, pack=True)
    assert batch.packed is None and not batch.context_BSC.is_meta
