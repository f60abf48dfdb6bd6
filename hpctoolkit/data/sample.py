"""One reassembled training sample, and the single buffer its fragments are read into.

A sample's fragments are fetched straight into one contiguous byte buffer laid out as

    [ input_ids : T x int64 | layer 0 : T x H | layer 1 : T x H | ... | last : T x H | loss_mask : T x uint8
      | sums of stage 0 | sums of stage 1 | ... ]

in manifest order (the mask only when the manifest names one; the stages' checksums, which the
reader checks the rest against, when it names them), so one batched `get_into` fills the whole
sample and no tensor is assembled by concatenating copies. `input_ids`, `aux_hidden_states`,
`last_hidden_states` and `loss_mask` are views into it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hpctoolkit import dtypes
from hpctoolkit.capture.manifest import Manifest
from hpctoolkit.errors import ConfigError, DataIntegrityError


class ReadEvent(Protocol):
    """What `BufferPool` needs of a `torch.cuda.Event` recorded after the device work that reads a
    buffer: whether that work is done, and a way to wait for it."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class BufferPool:
    """Recycles sample buffers so a fresh 300 MB buffer is not page-faulted in for every sample.

    A sample comes from the pool only through `fetch_sample(..., pool=)`, and goes back only when
    its consumer calls `Sample.release()`: a consumer that never releases just gets fresh buffers.
    At most `max_buffers` idle buffers are kept. `pin`: page-locked buffers (a CUDA reader copies
    each sample to its GPU; torch's host allocator caches freed page-locked blocks).

    Device reads. A copy from a page-locked buffer to a GPU (`Sample.copy_to`) is queued on a
    stream and may run long after the host moved on, so a buffer can come back while a copy still
    reads it. It comes back with the events recorded after those reads (`give(buf, until=)`), and
    `take` never hands it out before every one of them has completed: writing the next sample
    into it earlier would hand the device that sample's bytes. `take` prefers a fitting buffer
    whose reads are done and waits (`synchronize`) only when every fit is still being read (at
    most one queued copy, where a fresh page-locked buffer costs page faults and pinning). torch's host
    allocator does the same for a page-locked tensor that is freed, not pooled (it records an
    event on the copy's stream), so a buffer the full pool drops is safe as it is. A buffer given
    back without events (every CPU consumer) is handed out as before.
    """

    def __init__(self, max_buffers: int = 2, pin: bool = False):
        self.max_buffers = max_buffers
        self.pin = pin
        self._free: list[torch.Tensor] = []
        # id() of a buffer in `_free` -> the events its device reads end with; absent: none.
        self._until: dict[int, tuple[ReadEvent, ...]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        best: torch.Tensor | None = None
        until: tuple[ReadEvent, ...] = ()
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.numel() <= 2 * nbytes]
            if fits:
                ready = [b for b in fits if all(e.query() for e in self._until.get(id(b), ()))]
                best = min(ready or fits, key=lambda b: b.numel())
                self._free = [b for b in self._free if b is not best]
                until = self._until.pop(id(best), ())
                if ready:  # its reads have run: nothing to wait for
                    until = ()
        if best is not None:
            for event in until:  # outside the lock: another reader may take a ready buffer meanwhile
                event.synchronize()
            return best
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor, until: Sequence[ReadEvent] = ()) -> None:
        """Keep `buf` for a later `take` (if fewer than `max_buffers` are idle). `until`: events
        recorded after device work that still reads `buf`; `take` waits for them."""
        with self._lock:
            if len(self._free) < self.max_buffers:
                self._free.append(buf)
                if until:
                    self._until[id(buf)] = tuple(until)


@dataclass
class Sample:
    """A sample as the trainer sees it.

    `input_ids` is `[T]` int64; `aux_hidden_states` is `[n_aux, T, H]`, layer-major in manifest
    order (ascending capture id); `last_hidden_states` is `[T, H]`, taken before the target's final
    norm. All three are views into one buffer; keep or clone them as a whole.
    """

    key: str
    input_ids: torch.Tensor
    aux_hidden_states: torch.Tensor
    last_hidden_states: torch.Tensor
    manifest: Manifest
    # `[T]` uint8, 1 where the token is supervised; None when the manifest names no mask.
    loss_mask: torch.Tensor | None = None
    # The stages' sums objects (`capture.manifest`), one uint8 view each; empty for schema 1.
    sums: tuple[torch.Tensor, ...] = ()
    # `checksum.tensor_digest8` of each object `fetch_sample` checked, by key: what spooling the
    # sample records (`data.offline`) without hashing its bytes again.
    checked: dict[str, bytes] = field(default_factory=dict, repr=False)
    # The same sample on a GPU, checked there (`fetch_sample(device=...)`): what a CUDA trainer
    # collates from. None for a sample checked on the host.
    device_copy: Sample | None = field(default=None, repr=False)
    _buffer: torch.Tensor | None = field(default=None, repr=False)
    _pool: BufferPool | None = field(default=None, repr=False)
    # Events recorded after queued device work that reads `_buffer` (`in_use_until`).
    _reads: list[ReadEvent] = field(default_factory=list, repr=False, compare=False)

    def release(self) -> None:
        """Hand the buffer back to its pool. The sample's tensors must not be used afterwards.

        Call it once the sample has been consumed (e.g. its copy to the GPU queued). Optional:
        without it the buffer is simply freed when the last reference goes. A copy still queued
        (`copy_to`, `in_use_until`) keeps the pool from handing the buffer out until it has run.
        """
        if self._pool is not None and self._buffer is not None:
            if self._reads:
                self._pool.give(self._buffer, until=tuple(self._reads))
            else:
                self._pool.give(self._buffer)
        self._buffer = self._pool = None
        self._reads = []

    def in_use_until(self, event: ReadEvent) -> None:
        """Device work queued before `event` (recorded on that work's stream) reads this sample's
        buffer: `release()` keeps the pool from handing the buffer out before `event` completes.
        `copy_to` calls it for its own copy; a consumer that queues other reads calls it too."""
        self._reads.append(event)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def hidden_states_cat(self) -> torch.Tensor:
        """`[T, n_aux*H]`, the aux layers side by side (Eagle3/DFlash `fc` input). A new tensor: a copy."""
        n_aux, t, _ = self.aux_hidden_states.shape
        if n_aux == 0:
            return self.aux_hidden_states.new_empty((t, 0))
        return torch.cat(self.aux_hidden_states.unbind(0), dim=-1)

    @classmethod
    def empty_for(cls, manifest: Manifest, pool: BufferPool | None = None) -> Sample:
        """The sample's single buffer, uninitialised (from `pool` when given), with its views."""
        hidden_dtypes = {f.dtype for f in manifest.fragments}
        if not hidden_dtypes:
            raise DataIntegrityError(
                f"manifest of sample {manifest.sample_key!r}: field 'fragments' is empty"
            )
        if len(hidden_dtypes) != 1:
            raise DataIntegrityError(
                f"manifest of sample {manifest.sample_key!r}: field 'fragments' mixes dtypes "
                f"{sorted(hidden_dtypes)}; one sample buffer needs one hidden-state dtype"
            )
        try:
            dtype = dtypes.torch_dtype(hidden_dtypes.pop())
        except ConfigError as err:
            raise DataIntegrityError(f"manifest of sample {manifest.sample_key!r}: {err}") from None
        total = cls.buffer_bytes(manifest, dtype)
        backing = pool.take(total) if pool is not None else torch.empty(total, dtype=torch.uint8)
        return cls._on(manifest, dtype, backing, pool)

    @staticmethod
    def buffer_bytes(manifest: Manifest, dtype: torch.dtype) -> int:
        """The bytes of a sample's buffer: input_ids, hidden states, mask, sums, in that order."""
        t, h, n = manifest.num_tokens, manifest.hidden_size, len(manifest.fragments)
        elem = dtype.itemsize
        mask_bytes = t if manifest.loss_mask is not None else 0
        return t * 8 + n * t * h * elem + mask_bytes + sum(f.nbytes for f in manifest.sums)

    def copy_to(self, device: torch.device) -> Sample:
        """The sample's whole buffer copied to `device` in one copy, queued on the current stream
        (from page-locked memory, without the host waiting), with the same views. A copy from the
        host to a GPU records an event on that stream (`in_use_until`), so that the buffer, once
        `release()`d, is not handed out again before the copy has read it."""
        if self._buffer is None:
            raise DataIntegrityError(f"sample {self.key!r} was released: it has no buffer to copy")
        dtype = self.aux_hidden_states.dtype
        total = self.buffer_bytes(self.manifest, dtype)
        moved = self._buffer[:total].to(device, non_blocking=True)
        if moved.device.type == "cuda" and self._buffer.device.type == "cpu":
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(moved.device))
            self.in_use_until(copied)
        return self._on(self.manifest, dtype, moved, None)

    def used_on(self, stream: torch.cuda.Stream) -> None:
        """Tell the CUDA allocator that `stream` reads this (device) sample's buffer."""
        if self._buffer is not None:
            self._buffer.record_stream(stream)

    @classmethod
    def _on(
        cls, manifest: Manifest, dtype: torch.dtype, backing: torch.Tensor, pool: BufferPool | None
    ) -> Sample:
        t, h, n = manifest.num_tokens, manifest.hidden_size, len(manifest.fragments)
        ids_bytes = t * 8
        hidden_bytes = n * t * h * dtype.itemsize
        mask_bytes = t if manifest.loss_mask is not None else 0
        sums_at = ids_bytes + hidden_bytes + mask_bytes
        buf = backing[: cls.buffer_bytes(manifest, dtype)]
        ids = buf[:ids_bytes].view(torch.int64)
        hidden = buf[ids_bytes : ids_bytes + hidden_bytes].view(dtype).view(n, t, h)
        mask = buf[ids_bytes + hidden_bytes : sums_at] if mask_bytes else None
        sums = []
        for f in manifest.sums:
            sums.append(buf[sums_at : sums_at + f.nbytes])
            sums_at += f.nbytes
        return cls(
            key=manifest.sample_key,
            input_ids=ids,
            aux_hidden_states=hidden[: n - 1],
            last_hidden_states=hidden[n - 1],
            manifest=manifest,
            loss_mask=mask,
            sums=tuple(sums),
            _buffer=backing,
            _pool=pool,
        )

    def destinations(self) -> list[tuple[str, torch.Tensor]]:
        """(store key, destination view) for every object of the sample, in manifest order."""
        m = self.manifest
        out = [(m.input_ids.key, self.input_ids)]
        n_aux = self.aux_hidden_states.shape[0]
        for i, f in enumerate(m.fragments):
            out.append((f.key, self.aux_hidden_states[i] if i < n_aux else self.last_hidden_states))
        if m.loss_mask is not None:
            if self.loss_mask is None:
                raise DataIntegrityError(
                    f"sample {self.key!r}: the manifest names a loss_mask the sample lacks"
                )
            out.append((m.loss_mask.key, self.loss_mask))
        return out

    def sum_destinations(self) -> list[tuple[str, torch.Tensor]]:
        """(store key, destination view) of the stages' sums objects."""
        return [(f.key, t) for f, t in zip(self.manifest.sums, self.sums, strict=True)]
