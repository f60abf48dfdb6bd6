# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""DSpark loss: chunked CE on `lm_head + markov` logits, plus BCE for the confidence head."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hpctoolkit.models.dflash.layout import IGNORE_INDEX
from hpctoolkit.models.dspark.model import DSparkDraftModel, DSparkOutput


@dataclass
class DSparkLoss:
    total: torch.Tensor
    ce: torch.Tensor
    confidence: torch.Tensor
    accuracy: torch.Tensor


def _chunk(
    feat_NF: torch.Tensor, weight_VF: torch.Tensor, labels_N: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(feat_NF, weight_VF).float()
    ce = F.cross_entropy(logits, labels_N, ignore_index=IGNORE_INDEX, reduction="sum")
    return ce, (logits.argmax(-1) == labels_N)


def dspark_loss(
    model: DSparkDraftModel,
    out: DSparkOutput,
    labels_BT: torch.Tensor,
    *,
    confidence_weight: float = 0.1,
    chunk_size: int = 4096,
) -> DSparkLoss:
    """Mean CE over labelled slots; the confidence target is "the greedy draft token is right"."""
    feat_NF = torch.cat([out.hidden_BTH, out.markov_BTR], dim=-1).flatten(0, 1)
    weight = model.output_weight()
    labels_N = labels_BT.flatten()
    ce_sum = feat_NF.new_zeros((), dtype=torch.float32)
    hits = []
    for start in range(0, feat_NF.shape[0], chunk_size):
        sl = slice(start, start + chunk_size)
        if torch.is_grad_enabled():
            ce, hit = checkpoint(_chunk, feat_NF[sl], weight, labels_N[sl], use_reentrant=False)
        else:
            ce, hit = _chunk(feat_NF[sl], weight, labels_N[sl])
        ce_sum = ce_sum + ce
        hits.append(hit)
    valid_N = labels_N != IGNORE_INDEX
    count = valid_N.sum().clamp(min=1)
    hit_N = torch.cat(hits) & valid_N
    ce = ce_sum / count
    conf = ce.new_zeros(())
    if out.confidence_BT is not None:
        conf_N = out.confidence_BT.flatten()
        conf = F.binary_cross_entropy_with_logits(conf_N[valid_N], hit_N[valid_N].float())
    return DSparkLoss(ce + confidence_weight * conf, ce, conf, hit_N.sum() / count)
