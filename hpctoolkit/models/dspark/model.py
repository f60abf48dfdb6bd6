# ruff: noqa: N803, N806, N815  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""DSpark draft: the DFlash backbone plus markov and confidence heads."""

from dataclasses import dataclass

import torch

from hpctoolkit.models.dflash.layout import BlockLayout
from hpctoolkit.models.dflash.model import DFlashDraftModel, DFlashOutput
from hpctoolkit.models.dspark.config import DSparkConfig
from hpctoolkit.models.dspark.heads import ConfidenceHead, MarkovHead


@dataclass(kw_only=True)
class DSparkOutput(DFlashOutput):
    """Per draft slot `T`: `hidden_BTH` (pre-`lm_head`), `markov_BTR` (embedding of the previous
    ground-truth token), `confidence_BT` (acceptance logit, or None), and on request
    `logits_BTV` = `lm_head(hidden) + markov_w2(markov)` and `markov_logits_BTV` = the bias alone.
    A `DFlashOutput` (DSpark is a DFlash superset); the fields it adds are keyword-only."""

    markov_BTR: torch.Tensor
    confidence_BT: torch.Tensor | None
    markov_logits_BTV: torch.Tensor | None = None


class DSparkDraftModel(DFlashDraftModel):
    """DSpark draft.

    forward(context_BSC, input_ids_BS, layout, *, return_logits=False) -> DSparkOutput
      inputs as `DFlashDraftModel.forward`; the markov head reads `input_ids[a + k - 1]`
      (teacher forcing), so no extra input is needed. The full logits are
      `lm_head(hidden) + markov_w2(markov)`; the losses in `dspark.loss` compute them chunk by
      chunk, fused with the cross-entropy, instead of materialising `[B, T, V]`.
    """

    config: DSparkConfig
    config_class: type[DSparkConfig] = DSparkConfig

    def __init__(self, config: DSparkConfig) -> None:
        super().__init__(config)
        self.markov_head = MarkovHead(config.vocab_size, config.draft_vocab_size, config.markov_rank)
        self.confidence_head: ConfidenceHead | None = None
        if config.enable_confidence_head:
            dim = config.hidden_size + (config.markov_rank if config.confidence_head_with_markov else 0)
            self.confidence_head = ConfidenceHead(dim, config.confidence_head_with_markov)

    def forward(
        self,
        context_BSC: torch.Tensor,
        input_ids_BS: torch.Tensor,
        layout: BlockLayout,
        *,
        return_logits: bool = False,
    ) -> DSparkOutput:
        hidden_BTH = self.backbone(context_BSC, input_ids_BS, layout)
        markov_BTR = self.markov_head.embed(layout.prev_token_ids(input_ids_BS)).to(hidden_BTH.dtype)
        confidence_BT = None
        if self.confidence_head is not None:
            confidence_BT = self.confidence_head(hidden_BTH, markov_BTR)
        out = DSparkOutput(hidden_BTH, markov_BTR=markov_BTR, confidence_BT=confidence_BT)
        if return_logits:
            out.markov_logits_BTV = self.markov_head.bias(markov_BTR)
            out.logits_BTV = self.compute_logits(hidden_BTH) + out.markov_logits_BTV
        return out
