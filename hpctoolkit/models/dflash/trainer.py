# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""DFlash trainer: a fixed number of anchors per sample, blocks of anchor + mask tokens."""

from __future__ import annotations

import torch

from hpctoolkit.models.common.batch import Batch
from hpctoolkit.models.common.draft import DraftModel
from hpctoolkit.models.common.losses import LossParts
from hpctoolkit.models.common.trainer import (
    FamilyTrainer,
    ServedChains,
    TargetLogits,
    TrainerOptions,
    gather_rows,
    sample_generator,
)
from hpctoolkit.models.dflash.layout import (
    IGNORE_INDEX,
    check_anchor_range,
    make_block_layout,
    sample_anchors,
)
from hpctoolkit.models.dflash.loss import dflash_decay_gamma, dflash_loss
from hpctoolkit.models.dflash.model import DFlashDraftModel


def block_supervised(supervised_BS: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[B, S]` True at `a` where the tokens a block anchored there predicts, `a + 1 .. a + K - 1`,
    are all supervised (False where the block runs past the end)."""
    B, S = supervised_BS.shape
    c = torch.zeros(B, S + 1, dtype=torch.long)
    c[:, 1:] = supervised_BS.long().cumsum(1)
    a = torch.arange(S)
    end = (a + block_size).clamp(max=S)  # exclusive end of a + 1 .. a + K - 1
    inside = c[:, end] - c[:, (a + 1).clamp(max=S)]
    return (inside == block_size - 1) & (a + block_size <= S)


class DFlashTrainer(FamilyTrainer):
    """`num_anchors` blocks per sample, whatever its length, so attention shapes stay static.

    An anchor needs its whole block inside the sample and every token its block predicts
    supervised (`Batch.supervised_BS`); a sample with fewer eligible positions
    repeats an anchor and the surplus blocks are computed but carry no loss.
    """

    family = "dflash"
    unused_options: tuple[str, ...] = ("ttt_length",)
    draft: DFlashDraftModel

    # Evaluation mirrors serving, whose block is `num_speculative_tokens + 1` slots.
    block_size_override: int | None = None

    @property
    def block_size(self) -> int:
        return self.block_size_override or self.draft.config.block_size

    @property
    def num_positions(self) -> int:
        return self.block_size - 1

    @classmethod
    def served_chains(
        cls, draft: DraftModel, head: TargetLogits, k: int, prompt_len: int, out_len: int, seq_len: int
    ) -> ServedChains:
        """One block of `k + 1` slots (serving's size) anchored at every served bonus token."""
        anchors = torch.arange(prompt_len, prompt_len + out_len - 1).unsqueeze(0)
        # The anchors are given (no seed drawn); DFlash reads no unroll length.
        opts = TrainerOptions(seed=0, ttt_length=0, num_anchors=anchors.shape[1], label_source="target")
        trainer = cls(draft, head, opts)
        trainer.block_size_override = k + 1
        return ServedChains(
            trainer,
            torch.ones(1, seq_len, dtype=torch.bool),
            0,
            anchors.shape[1] - 1,
            {"anchors_BN": anchors, "anchor_ok_BN": torch.ones_like(anchors, dtype=torch.bool)},
        )

    def step_inputs(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        K, N = self.block_size, self.cfg.num_anchors
        host = batch.on_host()  # no device sync: the previous step may still be running
        pos_BS = torch.arange(batch.seq_len).unsqueeze(0)
        fits_BS = pos_BS + K - 1 < host.lengths_B.unsqueeze(1)
        eligible_BS = host.loss_mask_BS() & fits_BS & block_supervised(host.supervised_BS, K)
        anchors = torch.zeros(batch.batch_size, N, dtype=torch.long)
        ok = torch.zeros(batch.batch_size, N, dtype=torch.bool)
        if batch.seq_len >= N:
            for b, key in enumerate(batch.keys):
                g = sample_generator(self.cfg.seed, step, key)
                anchors[b : b + 1], ok[b : b + 1] = sample_anchors(eligible_BS[b : b + 1], N, K, generator=g)
        # else: too short to hold N distinct anchors; all blocks stay invalid, shapes stay static.
        check_anchor_range(anchors, batch.seq_len)  # here, on the host: `make_block_layout` won't on a GPU
        return {"anchors_BN": anchors, "anchor_ok_BN": ok}

    def block_targets(
        self,
        input_ids_BS: torch.Tensor,
        last_BSH: torch.Tensor,
        loss_mask_BS: torch.Tensor,
        anchors_BN: torch.Tensor,
        anchor_ok_BN: torch.Tensor,
    ):
        """Layout, target rows (the target's last state one before each slot) and CE labels.

        The losses form the target logits at the scored slots themselves, so no target head runs
        here: under `label_source: target` the labels are 0 at every supervised slot
        (IGNORE_INDEX elsewhere) for the loss to replace with the target's argmax.
        """
        K = self.block_size
        layout = make_block_layout(anchors_BN, K, input_ids_BS.shape[1])
        target_rows_BTH = gather_rows(last_BSH, layout.q_position_ids() - 1)
        data_labels_BT = layout.labels(input_ids_BS, loss_mask_BS)
        supervised_BT = (data_labels_BT != IGNORE_INDEX) & anchor_ok_BN.repeat_interleave(K, dim=1)
        src = data_labels_BT if self.cfg.label_source == "data" else torch.zeros_like(data_labels_BT)
        return layout, target_rows_BTH, src.masked_fill(~supervised_BT, IGNORE_INDEX)

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        context_BSC: torch.Tensor,
        last_BSH: torch.Tensor,
        loss_mask_BS: torch.Tensor,
        lengths_B: torch.Tensor,
        *,
        last_prenorm: bool,
        anchors_BN: torch.Tensor,
        anchor_ok_BN: torch.Tensor,
    ) -> LossParts:
        # The loss forms the target logits of every scored slot (accuracy and acceptance are
        # scored against their argmax), so it also takes the target-greedy labels from them.
        layout, target_rows_BTH, labels_BT = self.block_targets(
            input_ids_BS, last_BSH, loss_mask_BS, anchors_BN, anchor_ok_BN
        )
        out = self.draft(context_BSC, input_ids_BS, layout)
        return dflash_loss(
            out.hidden_BTH,
            self.draft.lm_head.weight,
            lambda rows_NH: self.target_logits(rows_NH, last_prenorm),
            target_rows_BTH,
            labels_BT,
            anchor_ok_BN,
            block_size=self.block_size,
            gamma=dflash_decay_gamma(self.block_size, self.draft.config.decay_gamma),
            labels_from_target=self.cfg.label_source == "target",
        )
