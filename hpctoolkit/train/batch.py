# ruff: noqa: N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Samples -> one padded training batch (`models.common.batch.Batch`, whose docstring lists what it
carries): `collate`, and the padded lengths of a compiled trainer (`length_step`, `padded_length`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.models.common.batch import Batch, PackedHidden, pad_rows

log = logging.getLogger(__name__)


def last_hidden_is_prenorm(sample: Any) -> bool:
    """Whether a sample's `last_hidden_states` precede the target's final norm.

    The manifest says so in `extra["last_hidden_states_prenorm"]`; vLLM captures pre-norm, so a
    manifest that does not say is taken as pre-norm.
    """
    manifest = getattr(sample, "manifest", None)
    extra = getattr(manifest, "extra", None)
    if extra is None and isinstance(manifest, dict):
        extra = manifest.get("extra")
    return bool((extra or {}).get("last_hidden_states_prenorm", True))


# Padded lengths are multiples of this many tokens at least (kernel tiles).
LENGTH_ALIGN = 16


def length_step(max_seq_len: int, lengths: int) -> int:
    """The step between the padded lengths of a compiled trainer: `max_seq_len / lengths` rounded
    up to a multiple of `LENGTH_ALIGN`, so that a batch takes one of at most `lengths + 1` lengths
    (the multiples of the step up to `max_seq_len`, and `max_seq_len` itself)."""
    step = -(-max_seq_len // lengths)
    return -(-step // LENGTH_ALIGN) * LENGTH_ALIGN


def padded_length(longest: int, max_seq_len: int, step: int) -> int:
    """A batch's length when its longest sample (after the cut) has `longest` tokens: the next
    multiple of `step`, at most `max_seq_len` (`step` 1: `longest` itself).

    `torch.compile` with static shapes (the trainer's layers) compiles once per batch length, and
    past its recompile limit (8 by default) runs a new length eager: with batches padded only to
    their longest sample, a run on real data left compiled code after eight lengths (2026-12-05).
    """
    if step <= 1:
        return longest
    return min(max_seq_len, -(-longest // step) * step)


def _hidden_batch(
    samples: Sequence[Any], seq_len: int, pin_memory: bool
) -> tuple[Sequence[Any], torch.Tensor, torch.Tensor]:
    """(what to read the hidden states from, the zeroed `[B, S, n_aux*H]` and `[B, S, H]`): the
    samples' device copies, and tensors on that device, when every sample has one."""
    copies = [getattr(s, "device_copy", None) for s in samples]
    hidden_from: Sequence[Any] = samples if any(c is None for c in copies) else copies
    aux, last = hidden_from[0].aux_hidden_states, hidden_from[0].last_hidden_states
    pin = pin_memory and aux.device.type == "cpu"
    n_aux, _, H = aux.shape
    B = len(samples)
    context = torch.zeros(B, seq_len, n_aux * H, dtype=aux.dtype, device=aux.device, pin_memory=pin)
    return (
        hidden_from,
        context,
        torch.zeros(B, seq_len, last.shape[-1], dtype=last.dtype, device=aux.device, pin_memory=pin),
    )


class _Hidden:
    """Where `collate` puts each sample's hidden states: the padded `[B, S, n_aux*H]` and
    `[B, S, H]` (`_hidden_batch`), or, when `pack`ing samples read on the host, their real rows
    one after another (`PackedHidden`) with meta tensors standing for the padded ones.

    Packing is for a CUDA trainer's host: on the H100 rung of 2026-12-08 (4096 conversations, 276
    tokens a sample on average, batches padded to their longest) the host's zero-fill and
    position-major copy took 65 % of the trainer's main thread, at 185 samples/s with the GPU 5 %
    busy; packed, the host copies each real row once (`benchmarks/collate.py`)."""

    def __init__(
        self, samples: Sequence[Any], lengths: Sequence[int], seq_len: int, pin_memory: bool, pack: bool
    ) -> None:
        # Collated from the host's copies unless every sample has one on the device.
        from_host = any(getattr(s, "device_copy", None) is None for s in samples)
        self.packed: PackedHidden | None = None
        self._at = 0
        if not (pack and from_host):
            self.sources, self.context, self.last = _hidden_batch(samples, seq_len, pin_memory)
            return
        aux, last = samples[0].aux_hidden_states, samples[0].last_hidden_states
        n_aux, _, H = aux.shape
        T, B = sum(lengths), len(samples)
        self.packed = PackedHidden(
            torch.empty(n_aux, T, H, dtype=aux.dtype, pin_memory=pin_memory),
            torch.empty(T, last.shape[-1], dtype=last.dtype, pin_memory=pin_memory),
            tuple(lengths),
        )
        self.sources = samples
        self.context = torch.empty(B, seq_len, n_aux * H, dtype=aux.dtype, device="meta")
        self.last = torch.empty(B, seq_len, last.shape[-1], dtype=last.dtype, device="meta")

    def put(self, b: int, n: int, aux: torch.Tensor, last: torch.Tensor) -> None:
        """Sample `b`'s first `n` rows."""
        if self.packed is None:
            B, S, _ = self.context.shape
            pad_rows(self.context.view(B, S, aux.shape[0], aux.shape[-1]), self.last, b, aux[:, :n], last[:n])
            return
        self.packed.aux_LTH[:, self._at : self._at + n].copy_(aux[:, :n])
        self.packed.last_TH[self._at : self._at + n].copy_(last[:n])
        self._at += n


def _check_shapes(s: Any, aux: torch.Tensor, last: torch.Tensor, n_aux: int, hidden: int) -> None:
    if aux.shape[0] != n_aux or aux.shape[-1] != hidden or aux.shape[1] != s.input_ids.shape[0]:
        raise DataIntegrityError(
            f"sample {s.key}: aux_hidden_states {tuple(aux.shape)} does not match "
            f"[{n_aux}, {s.input_ids.shape[0]}, {hidden}]"
        )
    if last.shape[0] != s.input_ids.shape[0]:
        raise DataIntegrityError(
            f"sample {s.key}: last_hidden_states has {last.shape[0]} rows, input_ids {s.input_ids.shape[0]}"
        )


def collate(
    samples: Sequence[Any],
    *,
    max_seq_len: int,
    min_loss_tokens: int,
    pin_memory: bool = False,
    step: int = 1,
    pack: bool | None = None,
) -> Batch:
    """Pad `samples` (objects with `key`, `input_ids`, `aux_hidden_states`, `last_hidden_states`)
    to `padded_length` of the longest (`step`: `length_step`'s, for a compiled trainer).

    `pin_memory` (a CUDA trainer) collates the hidden states into page-locked memory, so their copy
    to the device is queued without the host waiting for it (and runs at copy-engine speed: 58 ms
    of pageable copy a step at K3 shapes on an H200, `benchmarks/train_k3_gpu.py`).

    `pack` (default: `pin_memory`) keeps the hidden states packed (`Batch.packed`, `_Hidden`
    says why): each sample's real rows copied once, padded where the batch is moved to.

    Samples that each carry a `device_copy` (checked on a CUDA device, `fetch_sample(device=...)`)
    have their hidden states collated there, from those copies, on the current stream: the host
    neither copies them nor moves them again. The small tensors (ids, lengths, masks) are
    collated on the host either way, so a trainer reads them without waiting on the device.
    """
    if not samples:
        raise DataIntegrityError("collate got an empty list of samples")
    prenorm = {last_hidden_is_prenorm(s) for s in samples}
    if len(prenorm) != 1:
        raise DataIntegrityError(
            f"samples {[s.key for s in samples]} disagree on last_hidden_states_prenorm; "
            "one batch must come from one capture convention"
        )
    lengths = [min(int(s.input_ids.shape[0]), max_seq_len) for s in samples]
    truncated = sum(int(s.input_ids.shape[0]) > max_seq_len for s in samples)
    S = padded_length(max(lengths), max_seq_len, step)
    first = samples[0]
    n_aux, _, H = first.aux_hidden_states.shape
    B = len(samples)
    hidden = _Hidden(samples, lengths, S, pin_memory, pin_memory if pack is None else pack)
    input_ids = torch.zeros(B, S, dtype=torch.long, pin_memory=pin_memory)
    valid = torch.zeros(B, S, dtype=torch.bool)
    masked = torch.zeros(B, S, dtype=torch.bool)
    for b, (s, hs, n) in enumerate(zip(samples, hidden.sources, lengths, strict=True)):
        _check_shapes(s, hs.aux_hidden_states, hs.last_hidden_states, n_aux, H)
        input_ids[b, :n] = s.input_ids[:n]
        hidden.put(b, n, hs.aux_hidden_states, hs.last_hidden_states)
        valid[b, :n] = True
        mask = getattr(s, "loss_mask", None)
        if mask is None:
            masked[b, :n] = True
        else:
            if mask.shape[0] != s.input_ids.shape[0]:
                raise DataIntegrityError(
                    f"sample {s.key}: loss_mask has {mask.shape[0]} entries, input_ids {s.input_ids.shape[0]}"
                )
            masked[b, :n] = mask[:n].bool()
    lengths_t = torch.tensor(lengths, dtype=torch.long)
    weight = (lengths_t >= max(min_loss_tokens, 2)).float()
    if truncated:
        log.info("cut %d sample(s) to max_seq_len=%d", truncated, max_seq_len)
    supervised = valid & masked & (weight > 0).unsqueeze(1)
    if pin_memory:  # every tensor: a pageable copy to the device would wait for its stream to drain
        valid, lengths_t, weight, supervised = (
            t.pin_memory() for t in (valid, lengths_t, weight, supervised)
        )
    return Batch(
        keys=[str(s.key) for s in samples],
        input_ids_BS=input_ids,
        context_BSC=hidden.context,
        last_BSH=hidden.last,
        valid_BS=valid,
        lengths_B=lengths_t,
        weight_B=weight,
        last_prenorm=prenorm.pop(),
        truncated=truncated,
        supervised=supervised,
        packed=hidden.packed,
    )
