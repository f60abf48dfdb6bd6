# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""DSpark: per slot `0.1 * CE + 0.9 * L1(|p_draft - p_target|) + 1.0 * BCE(conf, 1 - L1/2)`.

`L1 = sum_v |p_draft(v) - p_target(v)|` lies in [0, 2]; `1 - L1/2 = sum_v min(p_draft, p_target)`
is the probability that speculative sampling accepts the draft token, which the confidence head
learns to predict (the target is detached). Slot `k` (`k >= 1`) is weighted `exp(-(k-1)/4)`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpctoolkit.models.dflash.layout import IGNORE_INDEX
from hpctoolkit.train.losses.common import LossParts, acceptance_from_matches, chunked_rows, per_position
from hpctoolkit.train.losses.dflash import slot_weights

DSPARK_CE_W = 0.1
DSPARK_L1_W = 0.9
DSPARK_BCE_W = 1.0
DSPARK_DECAY = 4.0


def dspark_loss(
    hidden_BTH: torch.Tensor,
    markov_BTR: torch.Tensor,
    lm_head_VH: torch.Tensor,
    markov_w2_VR: torch.Tensor,
    confidence_BT: torch.Tensor | None,
    target_logits_fn,
    target_rows_BTH: torch.Tensor,
    labels_BT: torch.Tensor,
    chain_ok_BN: torch.Tensor,
    *,
    block_size: int,
) -> LossParts:
    """Draft logits are `hidden @ lm_head.T + markov @ markov_w2.T` (DSpark's bigram bias);
    `target_logits_fn(rows_NH) -> [N, V]` (no grad) gives the target's at each slot from
    `target_rows_BTH` (the target's last state one position before the slot)."""
    B, T, _ = hidden_BTH.shape
    K = block_size
    N = T // K

    def rows(h_NH, m_NR, t_NH, lab_N, w_VH, w2_VR):
        logits = (F.linear(h_NH, w_VH) + F.linear(m_NR, w2_VR)).float()
        tgt = target_logits_fn(t_NH)
        ce = F.cross_entropy(logits, lab_N, ignore_index=IGNORE_INDEX, reduction="none")
        l1 = (logits.softmax(-1) - tgt.softmax(-1)).abs().sum(-1)
        return ce, l1, logits.argmax(-1), tgt.argmax(-1)

    ce_N, l1_N, pred_N, tgt_N = chunked_rows(
        rows,
        hidden_BTH.flatten(0, 1),
        markov_BTR.flatten(0, 1),
        target_rows_BTH.flatten(0, 1),
        labels_BT.flatten(),
        consts=(lm_head_VH, markov_w2_VR),
    )
    mask_BT = labels_BT != IGNORE_INDEX
    w_BT = slot_weights(K, DSPARK_DECAY, hidden_BTH.device).repeat(N).unsqueeze(0) * mask_BT
    ce_BT, l1_BT = ce_N.view(B, T), l1_N.view(B, T)
    per_slot_BT = DSPARK_CE_W * ce_BT + DSPARK_L1_W * l1_BT
    bce_BT = torch.zeros_like(ce_BT)
    if confidence_BT is not None:
        accept_p = (1.0 - 0.5 * l1_BT.detach()).clamp(0.0, 1.0)
        bce_BT = F.binary_cross_entropy_with_logits(confidence_BT.float(), accept_p, reduction="none")
        per_slot_BT = per_slot_BT + DSPARK_BCE_W * bce_BT
    numerator = (per_slot_BT * w_BT).sum()
    denominator = w_BT.sum().detach()

    def slots(x_BT: torch.Tensor) -> torch.Tensor:
        return x_BT.reshape(B * N, K)[:, 1:]

    match_BT = pred_N.view(B, T) == tgt_N.view(B, T)
    chain_ok = chain_ok_BN.reshape(-1)
    pos_mask = slots(mask_BT) & chain_ok.unsqueeze(1)
    loss_sum, loss_w = per_position(slots(per_slot_BT), pos_mask)
    correct, count = per_position(slots(match_BT), pos_mask)
    reach, chains = acceptance_from_matches(slots(match_BT), chain_ok)
    wd = w_BT.detach()
    extras = {
        "ce": (ce_BT.detach() * wd).sum(),
        "l1": (l1_BT.detach() * wd).sum(),
        "bce": (bce_BT.detach() * wd).sum(),
    }
    return LossParts(
        numerator, denominator, loss_sum, loss_w, correct, count, reach, chains, extras, slots(match_BT)
    )
