# ruff: noqa: N802, N803, N806, N815  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""`Batch`: one padded training batch, what a family's trainer hooks read (`common.trainer`).

It lives here, beside the hooks that read it, rather than with the collation that builds it
(`train.batch.collate`), so the families need nothing from `train/`. A `Batch` carries everything
every draft family reads, right-padded to the longest sample (or, for a compiled trainer, past it
to the next of a few fixed lengths: `train.batch.padded_length`):

- `input_ids_BS` int64, padding 0;
- `context_BSC` the captured aux states concatenated per position in `target_layer_ids`
  order, `[B, S, n_aux * H]` (what DFlash's `fc` and Eagle3's `fc` read);
- `last_BSH` the target's last hidden state (pre-norm when `last_prenorm`);
- `valid_BS` True on real (non-pad) positions;
- `supervised_BS` True on the tokens the loss may be computed on: real tokens of a sample with
  nonzero weight where the sample's loss mask is 1 (a sample without a mask: all its tokens).
  Families read it where their targets are: Eagle3 at each TTT step's target token, DFlash and
  DSpark only draw anchors whose whole block is supervised;
- `weight_B` 1.0, or 0.0 for a sample shorter than `min_loss_tokens`. Such a sample still runs
  through forward and backward, so every rank issues the same collectives; it just contributes
  nothing to the loss.

A batch collated for a CUDA trainer keeps its hidden states `packed` (`PackedHidden`): only the
real rows, in the layout they were captured in, so the host copies each sample's states once and
the copy engine moves only those rows; `to(device)` pads them there. Until then `context_BSC` and
`last_BSH` are meta tensors: their shapes are known, and reading their data fails.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def pad_rows(
    context_BSLH: torch.Tensor, last_BSH: torch.Tensor, b: int, aux_LnH: torch.Tensor, last_nH: torch.Tensor
) -> None:
    """Sample `b`'s `n` rows into padded tensors: `[n_aux, n, H]` layer-major becomes position-major
    with the layers in order (one strided copy, and cast, with no temporary), the last state beside."""
    n = aux_LnH.shape[1]
    context_BSLH[b, :n].copy_(aux_LnH.transpose(0, 1))
    last_BSH[b, :n].copy_(last_nH)


@dataclass
class PackedHidden:
    """A batch's hidden states as the host collates them for a device: the samples' real rows only.

    - `aux_LTH` `[n_aux, T, H]` layer-major as captured, the samples one after another on `T`
      (T = the sum of `lengths`);
    - `last_TH` `[T, H]`;
    - `lengths` each sample's rows, in batch order.

    `unpack` builds the padded `[B, S, n_aux * H]` and `[B, S, H]` wherever the tensors are: zeros,
    then each sample's rows, position-major, layers in order. Bitwise what padding on the host gives.
    """

    aux_LTH: torch.Tensor
    last_TH: torch.Tensor
    lengths: tuple[int, ...]

    def to(self, device: torch.device | str) -> PackedHidden:
        return PackedHidden(
            self.aux_LTH.to(device, non_blocking=True),
            self.last_TH.to(device, non_blocking=True),
            self.lengths,
        )

    def unpack(self, seq_len: int, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        n_aux, _, H = self.aux_LTH.shape
        B, dev = len(self.lengths), self.aux_LTH.device
        context = torch.zeros(B, seq_len, n_aux, H, dtype=dtype or self.aux_LTH.dtype, device=dev)
        last = torch.zeros(B, seq_len, self.last_TH.shape[-1], dtype=dtype or self.last_TH.dtype, device=dev)
        start = 0
        for b, n in enumerate(self.lengths):
            pad_rows(context, last, b, self.aux_LTH[:, start : start + n], self.last_TH[start : start + n])
            start += n
        return context.view(B, seq_len, n_aux * H), last


@dataclass
class Batch:
    keys: list[str]
    input_ids_BS: torch.Tensor
    context_BSC: torch.Tensor
    last_BSH: torch.Tensor
    valid_BS: torch.Tensor
    lengths_B: torch.Tensor
    weight_B: torch.Tensor
    last_prenorm: bool
    truncated: int = 0
    # `supervised_BS` as collated; None (a batch built by hand) means every valid token.
    supervised: torch.Tensor | None = None
    # The CPU batch this one was moved from (`to`): what the host reads without waiting on the
    # device (anchor sampling), so a step queued behind another never syncs.
    host: Batch | None = field(default=None, repr=False, compare=False)
    # The hidden states of a batch collated for a device (`PackedHidden`); `context_BSC` and
    # `last_BSH` are meta tensors until `to` pads them on the device.
    packed: PackedHidden | None = field(default=None, repr=False, compare=False)

    def on_host(self) -> Batch:
        """This batch's CPU original; itself if it lives on the CPU (else a copy, which syncs)."""
        original = self._host_original()
        return original if original is not None else self.to("cpu")

    def _host_original(self) -> Batch | None:
        """The CPU batch to remember when moving this one (never a copy made for the purpose)."""
        return self if self.input_ids_BS.device.type == "cpu" else self.host

    @property
    def supervised_BS(self) -> torch.Tensor:
        return self.loss_mask_BS() if self.supervised is None else self.supervised

    @property
    def supervised_tokens(self) -> int:
        """Tokens the loss may be computed on (see `supervised_BS`)."""
        return int(self.supervised_BS.sum())

    @property
    def batch_size(self) -> int:
        return self.input_ids_BS.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids_BS.shape[1]

    def loss_mask_BS(self) -> torch.Tensor:
        """Positions that may be supervised: real tokens of samples with nonzero weight."""
        return self.valid_BS & (self.weight_B > 0).unsqueeze(1)

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> Batch:
        def mv(t: torch.Tensor, float_dtype: torch.dtype | None = None) -> torch.Tensor:
            return t.to(device=device, dtype=float_dtype or t.dtype, non_blocking=True)

        if self.packed is not None:
            context, last = self.packed.to(device).unpack(self.seq_len, dtype)
        else:
            context, last = mv(self.context_BSC, dtype), mv(self.last_BSH, dtype)
        return Batch(
            self.keys,
            mv(self.input_ids_BS),
            context,
            last,
            mv(self.valid_BS),
            mv(self.lengths_B),
            mv(self.weight_B),
            self.last_prenorm,
            self.truncated,
            None if self.supervised is None else mv(self.supervised),
            host=self._host_original() if torch.device(device).type != "cpu" else None,
        )
