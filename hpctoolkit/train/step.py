"""One optimizer step queued on the device without the host waiting for it.

The training loop keeps the device one step ahead of the host: it queues step `n + 1` before it
reads step `n`'s statistics, so the host reads, collates and copies the next batch, and draws its
anchors, while the device still computes. Nothing in `launch` reads a device value on the host:
the statistics of a step (loss parts, token counts, gradient norm) are reduced in one collective
and copied to page-locked host memory behind an event, and `LaunchedStep.result` waits for that
event only. On the CPU every call simply runs to completion.

`DeviceFeeder` moves a collated (page-locked) batch to the device on a copy stream, so the copy
overlaps the step before it instead of queueing behind it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import torch

from hpctoolkit.models.common.batch import Batch
from hpctoolkit.models.common.losses import LossParts
from hpctoolkit.train.optim import clip_grad_norm

T = TypeVar("T")  # a launched step (`LaunchedStep`), or anything a test queues


def forward_backward(trainer, batch: Batch, step: int, ctx) -> LossParts:
    """Forward, normalise by the global denominator, backward. Returns this rank's `LossParts`.

    The denominator is summed over ranks and the local numerator scaled by `world_size`, so after
    FSDP averages gradients the step's gradient is that of `sum(numerators) / sum(denominators)`.
    The scale stays on the device: reading it on the host would stall the queue before backward.
    """
    parts = trainer.run(batch, step)
    den = ctx.all_reduce_sum(parts.denominator.detach().to(torch.float64).reshape(1).clone())
    scale = (ctx.world_size / den.clamp_min(1e-12)).to(parts.numerator.dtype)
    (parts.numerator * scale).sum().backward()
    return parts


@dataclass
class StepResult:
    """A finished step's statistics on the host, summed over ranks."""

    stats: torch.Tensor  # `LossParts.stats_vector()` summed over ranks, fp64
    supervised_tokens: float
    tokens: float
    grad_norm: float


@dataclass
class LaunchedStep:
    """A step queued on the device; `result()` waits for it (and only it) to finish."""

    extras: tuple[str, ...]
    lr: float
    launched_at: float
    _vec: torch.Tensor
    _done: torch.cuda.Event | None

    def result(self) -> StepResult:
        if self._done is not None:
            self._done.synchronize()
        v = self._vec
        return StepResult(v[:-3].clone(), float(v[-3]), float(v[-2]), float(v[-1]))


def launch(trainer, optimizer, scheduler, batch: Batch, step: int, ctx, grad_clip: float) -> LaunchedStep:
    """Queue forward, backward, clipping and the optimizer step on `batch`; no host sync."""
    t0 = time.monotonic()
    parts = forward_backward(trainer, batch, step, ctx)
    grad_norm = clip_grad_norm(trainer, grad_clip, optimizer)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    dev = parts.numerator.device
    counts = torch.stack([batch.supervised_BS.sum(), batch.lengths_B.sum()]).to(torch.float64)
    vec = ctx.all_reduce_sum(torch.cat([parts.stats_vector(), counts]))
    # The norm is already global (clipping reduces it over ranks): appended after the sum.
    vec = torch.cat([vec, grad_norm.detach().to(dev, torch.float64).reshape(1)])
    done = None
    if dev.type == "cuda":
        host = torch.empty(vec.shape, dtype=vec.dtype, pin_memory=True)
        host.copy_(vec, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        vec = host
    return LaunchedStep(tuple(parts.extras), lr, t0, vec, done)


def one_ahead(launches: Iterable[T]) -> Iterator[T]:
    """Each launched step, handed back once the next one is queued (the last when none follows):
    the host reads step `n`'s statistics with step `n + 1` already on the device. `launches` is
    consumed lazily, so a generator that reads and launches a batch per item keeps the overlap.
    (`loop.py` writes the same order out by hand, with checkpoints between steps.)"""
    pending: T | None = None
    for launched in launches:
        if pending is not None:
            yield pending
        pending = launched
    if pending is not None:
        yield pending


class DeviceFeeder:
    """Moves batches to the device on a side stream (CUDA), the compute stream waiting for them."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def put(self, batch: Batch) -> Batch:
        if self.stream is None:
            return batch.to(self.device, self.dtype)
        compute = torch.cuda.current_stream(self.device)
        if batch.context_BSC.is_cuda:
            # Collated on the device (`collate`), on the compute stream: the copy stream reads it.
            self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            moved = batch.to(self.device, self.dtype)
        compute.wait_stream(self.stream)
        tensors = [moved.input_ids_BS, moved.context_BSC, moved.last_BSH, moved.valid_BS]
        tensors += [moved.lengths_B, moved.weight_B] + (
            [moved.supervised] if moved.supervised is not None else []
        )
        for t in tensors:
            t.record_stream(compute)  # allocated on the copy stream, freed after use on this one
        return moved
