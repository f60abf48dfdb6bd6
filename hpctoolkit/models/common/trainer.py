# ruff: noqa: N803, N815  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""`FamilyTrainer`: the trainer hooks a draft family declares, and the unit FSDP wraps, holding one
draft and the target's frozen head.

This is the family side of the training contract (torchtitan's `TrainSpec` idea): each family
subclasses it in `models/<family>/trainer.py`, `models.registry` names it with the family's config,
model and serving record, and `train/` only looks it up there, so `models/` never imports `train/`.
What the hooks take and return is therefore declared at or below this module, each piece the
simplest way:

- `Batch` (`common.batch`) and `LossParts` (`common.losses`) live beside the hooks: they are plain
  torch records, and the families' losses build `LossParts` anyway;
- the target head comes in through the one-method protocol `TargetLogits`, since reading it from
  a checkpoint (`train.target_head`) needs `targets/`, and the hooks only ask it for logits;
- the training options the hooks read are copied into `TrainerOptions` by `train.build` (and
  built directly by `served_chains`), so `TrainingConfig` stays with the recipe's sections.

Its `forward` takes plain tensors (so FSDP's mixed-precision policy can cast them) and returns
`LossParts`. Everything random about a step (DFlash anchors) is drawn by `step_inputs` from
generators seeded by `(seed, step, sample key)`: a resumed run draws exactly what the
uninterrupted run would have without depending on restored RNG state, and a sample gets the same
anchors whichever rank reads it, so 1 and N ranks compute the same global step.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from hpctoolkit.models.common.batch import Batch
from hpctoolkit.models.common.draft import DraftModel
from hpctoolkit.models.common.losses import LossParts


class TargetLogits(Protocol):
    """The target's frozen output head, as the hooks use it (`train.target_head.TargetHead`)."""

    def logits(self, last_NH: torch.Tensor, *, prenorm: bool) -> torch.Tensor: ...


@dataclass(frozen=True)
class TrainerOptions:
    """The `training.*` options a family's hooks read (`train.config.TrainingConfig` names and
    checks them; `train.build.build_trainer` copies them here). No defaults: every builder says
    each one, so these cannot drift from the recipe's."""

    seed: int
    # Eagle3: the test-time-training unroll.
    ttt_length: int
    # DFlash / DSpark: anchors per sample, and where the CE labels come from ("target" | "data").
    num_anchors: int
    label_source: str


def sample_generator(seed: int, step: int, key: str) -> torch.Generator:
    """The generator for one sample at one step (independent of rank and batch position)."""
    g = torch.Generator()
    g.manual_seed(((seed * 1_000_003 + step) * 65_537 + zlib.crc32(key.encode())) % (2**63))
    return g


def gather_rows(x_BSH: torch.Tensor, pos_BT: torch.Tensor) -> torch.Tensor:
    """`x[b, pos[b, t]]` -> `[B, T, H]` (positions clamped into range)."""
    idx = pos_BT.clamp(0, x_BSH.shape[1] - 1)
    return x_BSH.gather(1, idx.unsqueeze(-1).expand(-1, -1, x_BSH.shape[-1]))


@dataclass
class ServedChains:
    """A trainer and forward inputs whose chains are a served request's verifications.

    Chains `first .. last` of the forward's `chain_matches` are, in order, the chains vLLM drafts
    from each position of the served output (see `FamilyTrainer.served_chains`).
    """

    trainer: FamilyTrainer
    loss_mask_BS: torch.Tensor
    first: int
    last: int
    step: dict[str, torch.Tensor] = field(default_factory=dict)


class FamilyTrainer(nn.Module):
    """Draft + frozen target head. Subclasses set `num_positions` and implement the hooks.

    Class attributes a family sets: `family` (its name in logs and checkpoint metadata),
    `unused_options` (training options that have no effect on it, warned about), and
    `prunes_vocab` (whether its draft may have `draft_vocab_size < vocab_size`). A family's
    trainer (`models/<family>/trainer.py`) narrows `draft` to its model class: `models.registry`
    names both for one config, by family. This module never imports the registry.

    Each family defines `forward(input_ids_BS, context_BSC, last_BSH, loss_mask_BS, lengths_B, *,
    last_prenorm, **step) -> LossParts`, where `step` is exactly what its `step_inputs` returns
    (so the keywords differ by family, and this class declares no `forward` of its own).
    """

    family = "base"
    unused_options: tuple[str, ...] = ()
    prunes_vocab = False
    draft: DraftModel

    def __init__(self, draft: DraftModel, head: TargetLogits, cfg: TrainerOptions) -> None:
        super().__init__()
        self.draft = draft
        self.head = head
        self.cfg = cfg

    @property
    def num_positions(self) -> int:
        """`P`: draft positions scored per chain (DFlash K-1 slots, Eagle3 ttt_length)."""
        raise NotImplementedError

    @classmethod
    def served_chains(
        cls, draft: DraftModel, head: TargetLogits, k: int, prompt_len: int, out_len: int, seq_len: int
    ) -> ServedChains:
        """The chains vLLM verifies when it serves `k` drafts per step after a `prompt_len`
        prompt until `out_len` tokens exist, over a sequence of `seq_len` tokens (prompt, output
        and `k` greedy tokens past it); the served verifications are anchored at the bonus
        tokens `prompt_len .. prompt_len + out_len - 2`."""
        raise NotImplementedError

    def shard_units(self) -> list[nn.Module]:
        """Submodules that become their own FSDP groups (the decoder layers)."""
        return list(getattr(self.draft, "layers", []))

    def step_inputs(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        """Per-step tensors beyond the batch (anchors); drawn on the CPU."""
        return {}

    def target_logits(self, rows_NH: torch.Tensor, prenorm: bool) -> torch.Tensor:
        return self.head.logits(rows_NH, prenorm=prenorm)

    def run(self, batch: Batch, step: int) -> LossParts:
        """Forward one batch (already on the device) at optimizer step `step`."""
        dev = batch.input_ids_BS.device
        # Drawn on the host: moved from page-locked memory, since a pageable copy to a CUDA
        # device first waits for everything queued on the stream (the previous step, in the loop).
        pin = dev.type == "cuda"
        extra = {
            k: (v.pin_memory() if pin else v).to(dev, non_blocking=True)
            for k, v in self.step_inputs(batch, step).items()
        }
        return self(
            batch.input_ids_BS,
            batch.context_BSC,
            batch.last_BSH,
            batch.loss_mask_BS(),
            batch.lengths_B,
            last_prenorm=batch.last_prenorm,
            **extra,
        )
