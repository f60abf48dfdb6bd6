# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""DSpark trainer (also the Kimi-K3 MLA variant): DFlash blocks, DSpark's three-term loss."""

from __future__ import annotations

import torch

from hpctoolkit.models.common.losses import LossParts
from hpctoolkit.models.dflash.trainer import DFlashTrainer
from hpctoolkit.models.dspark.loss import dspark_decay_gamma, dspark_loss
from hpctoolkit.models.dspark.model import DSparkDraftModel


class DSparkTrainer(DFlashTrainer):
    family = "dspark"
    unused_options = ("ttt_length",)
    draft: DSparkDraftModel

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
        # The loss forms the target logits of every scored slot for its L1 term anyway, so it
        # also takes the target-greedy labels from them: one target-head pass a step, not two.
        layout, target_rows_BTH, labels_BT = self.block_targets(
            input_ids_BS, last_BSH, loss_mask_BS, anchors_BN, anchor_ok_BN
        )
        out = self.draft(context_BSC, input_ids_BS, layout)
        return dspark_loss(
            out.hidden_BTH,
            out.markov_BTR.to(out.hidden_BTH.dtype),
            self.draft.lm_head.weight,
            self.draft.markov_head.markov_w2.weight,
            out.confidence_BT,
            lambda rows_NH: self.target_logits(rows_NH, last_prenorm),
            target_rows_BTH,
            labels_BT,
            anchor_ok_BN,
            block_size=self.block_size,
            gamma=dspark_decay_gamma(self.draft.config.decay_gamma),
            labels_from_target=self.cfg.label_source == "target",
        )
