# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BTH), per STYLE.md
"""DSpark loss: fused CE on `lm_head + markov` logits, plus BCE for the confidence head."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hpctoolkit.models.common.fused_ce import fused_linear_cross_entropy
from hpctoolkit.models.dflash.layout import IGNORE_INDEX
from hpctoolkit.models.dspark.model import DSparkDraftModel, DSparkOutput


@dataclass
class DSparkLoss:
    total: torch.Tensor
    ce: torch.Tensor
    confidence: torch.Tensor
    accuracy: torch.Tensor


def dspark_loss(
    model: DSparkDraftModel,
    out: DSparkOutput,
    labels_BT: torch.Tensor,
    *,
    confidence_weight: float = 0.1,
    chunk_size: int = 4096,
    compile_elementwise: bool = False,
) -> DSparkLoss:
    """Mean CE over labelled slots; the confidence target is "the greedy draft token is right"."""
    labels_N = labels_BT.flatten()
    ce, hit_N = fused_linear_cross_entropy(
        out.hidden_BTH.flatten(0, 1),
        model.lm_head.weight,
        labels_N,
        extra_NR=out.markov_BTR.flatten(0, 1),
        extra_weight_VR=model.markov_head.markov_w2.weight,
        chunk_size=chunk_size,
        compile_elementwise=compile_elementwise,
    )
    valid_N = labels_N != IGNORE_INDEX
    hit_N = hit_N & valid_N
    count = valid_N.sum().clamp(min=1)
    conf = ce.new_zeros(())
    if out.confidence_BT is not None:
        # Mean over labelled slots as a weighted sum: no boolean indexing, so no device sync.
        conf_N = out.confidence_BT.flatten()
        conf = (
            F.binary_cross_entropy_with_logits(
                conf_N, hit_N.to(conf_N.dtype), weight=valid_N.to(conf_N.dtype), reduction="sum"
            )
            / count
        )
    return DSparkLoss(ce + confidence_weight * conf, ce, conf, hit_N.sum() / count)
