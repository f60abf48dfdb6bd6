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
from dataclasses import dataclass, field

import torch

from hpctoolkit import dtypes
from hpctoolkit.capture.manifest import Manifest
from hpctoolkit.errors import ConfigError, DataIntegrityError


class BufferPool:
    """Recycles sample buffers so a fresh 300 MB buffer is not page-faulted in for every sample.

    A sample comes from the pool only through `fetch_sample(..., pool=)`, and goes back only when
    its consumer calls `Sample.release()`: a consumer that never releases just gets fresh buffers.
    At most `max_buffers` idle buffers are kept. `pin`: page-locked buffers (a CUDA reader copies
    each sample to its GPU; torch's host allocator caches freed page-locked blocks).
    """

    def __init__(self, max_buffers: int = 2, pin: bool = False):
        self.max_buffers = max_buffers
        self.pin = pin
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [b for b in self._free if nbytes <= b.numel() <= 2 * nbytes]
            if fits:
                best = min(fits, key=lambda b: b.numel())
                self._free = [b for b in self._free if b is not best]
                return best
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self.max_buffers:
                self._free.append(buf)


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

    def release(self) -> None:
        """Hand the buffer back to its pool. The sample's tensors must not be used afterwards.

        Call it once the sample has been consumed (e.g. copied to the GPU). Optional: without it
        the buffer is simply freed when the last reference goes.
        """
        if self._pool is not None and self._buffer is not None:
            self._pool.give(self._buffer)
        self._buffer = self._pool = None

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
        elem = torch.empty((), dtype=dtype).element_size()
        mask_bytes = t if manifest.loss_mask is not None else 0
        return t * 8 + n * t * h * elem + mask_bytes + sum(f.nbytes for f in manifest.sums)

    def copy_to(self, device: torch.device) -> Sample:
        """The sample's whole buffer copied to `device` in one copy, queued on the current stream
        (from page-locked memory, without the host waiting), with the same views."""
        if self._buffer is None:
            raise DataIntegrityError(f"sample {self.key!r} was released: it has no buffer to copy")
        dtype = self.aux_hidden_states.dtype
        total = self.buffer_bytes(self.manifest, dtype)
        return self._on(self.manifest, dtype, self._buffer[:total].to(device, non_blocking=True), None)

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
        hidden_bytes = n * t * h * torch.empty((), dtype=dtype).element_size()
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
