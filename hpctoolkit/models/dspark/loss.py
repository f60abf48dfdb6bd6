# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BTH), per STYLE.md
"""DSpark: per slot `0.1 * CE + 0.9 * L1(|p_draft - p_target|) + 1.0 * BCE(conf, 1 - L1/2)`.

`L1 = sum_v |p_draft(v) - p_target(v)|` lies in [0, 2]; `1 - L1/2 = sum_v min(p_draft, p_target)`
is the probability that speculative sampling accepts the draft token, which the confidence head
learns to predict (the target is detached). Slot `k` (`k >= 1`) is weighted `exp(-(k-1)/gamma)`,
`gamma` the draft config's `decay_gamma` (0: DSpark's 4).

The CE and L1 terms are fused with the vocabulary GEMMs (`_FusedDSparkRows`): each row chunk's
draft and target logits are formed once, the loss and its gradient with respect to the logits
are computed together, and the gradient GEMMs run at once, so backward only rescales stored
gradients. No `[rows, V]` tensor outlives its chunk and no logits are recomputed in backward.
Slot 0 of every block (the anchor, weight 0, dropped from every statistic) is never computed.

`dspark_ce_loss` is the simpler model-level loss the model tests and `benchmarks/draft_step.py`
time: fused CE on `lm_head + markov` logits, plus BCE of the confidence head against "the greedy
draft token is right".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hpctoolkit.models.common.fused_ce import fused_linear_cross_entropy
from hpctoolkit.models.common.fused_rows import drop_anchor, fused_block_rows, row_targets, unslot
from hpctoolkit.models.common.losses import LOGIT_CHUNK_ROWS, LossParts, acceptance_from_matches, per_position
from hpctoolkit.models.dflash.layout import IGNORE_INDEX
from hpctoolkit.models.dflash.loss import slot_weights
from hpctoolkit.models.dspark.model import DSparkDraftModel, DSparkOutput

DSPARK_CE_W = 0.1
DSPARK_L1_W = 0.9
DSPARK_BCE_W = 1.0
DSPARK_DECAY = 4.0


def dspark_decay_gamma(configured: float = 0.0) -> float:
    """The slot decay: the config's `decay_gamma` when positive, else DSpark's 4."""
    return configured if configured > 0 else DSPARK_DECAY


def _dspark_rows(
    z_NV: torch.Tensor,
    t_NV: torch.Tensor,
    labels_N: torch.Tensor,
    w_N: torch.Tensor,
    grad_dtype: torch.dtype,
    labels_from_target: bool = False,
):
    """One chunk: `(sum_n w_n (0.1 ce_n + 0.9 l1_n), (ce_N, l1_N, draft argmax, target argmax),
    d(that sum)/d z_NV)`. `z_NV` draft logits, `t_NV` target logits, `w_N` the slot weights.
    `labels_from_target`: each supervised row's label is the target's argmax (`t_NV`'s)."""
    acc = torch.promote_types(z_NV.dtype, torch.float32)  # fp32, or fp64 in the CPU tests
    z = z_NV.to(acc)
    t = t_NV.to(acc)
    tgt, labels_N = row_targets(t, labels_N, labels_from_target)
    p = torch.exp(z - torch.logsumexp(z, dim=-1, keepdim=True))
    q = torch.exp(t - torch.logsumexp(t, dim=-1, keepdim=True))
    d = p - q
    l1 = d.abs().sum(-1)
    s = torch.sign(d)  # d|x|/dx, 0 at 0 as autograd's abs
    valid = labels_N != IGNORE_INDEX
    safe = labels_N.clamp(min=0).unsqueeze(1)
    logp_label = z.gather(1, safe).squeeze(1) - torch.logsumexp(z, dim=-1)
    ce = -logp_label * valid
    total = (w_N * (DSPARK_CE_W * ce + DSPARK_L1_W * l1)).sum()
    # d ce / dz = p - onehot(label); d l1 / dz = p * (s - <s, p>) (softmax Jacobian).
    grad = DSPARK_CE_W * p + DSPARK_L1_W * p * (s - (s * p).sum(-1, keepdim=True))
    grad = grad.scatter_add(1, safe, (-DSPARK_CE_W * valid.to(grad.dtype)).unsqueeze(1))
    return total, (ce, l1, z.argmax(-1), tgt), (grad * w_N.unsqueeze(1)).to(grad_dtype)


def _confidence_bce(confidence_BT: torch.Tensor, l1_BT: torch.Tensor) -> torch.Tensor:
    """Per-slot BCE of the confidence logit against the acceptance probability `1 - L1/2`."""
    accept_p = (1.0 - 0.5 * l1_BT).clamp(0.0, 1.0)
    conf_BT = confidence_BT.to(torch.promote_types(confidence_BT.dtype, torch.float32))
    return F.binary_cross_entropy_with_logits(conf_BT, accept_p.to(conf_BT.dtype), reduction="none")


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
    gamma: float = DSPARK_DECAY,
    chunk_rows: int = LOGIT_CHUNK_ROWS,
    compile_elementwise: bool | None = None,
    labels_from_target: bool = False,
) -> LossParts:
    """Draft logits are `hidden @ lm_head.T + markov @ markov_w2.T` (DSpark's bigram bias);
    `target_logits_fn(rows_NH) -> [N, V]` (no grad) gives the target's at each slot from
    `target_rows_BTH` (the target's last state one position before the slot).

    `labels_from_target`: `labels_BT` only marks the supervised slots (any id there, IGNORE_INDEX
    elsewhere); each one's CE label is the target's argmax from those same target logits, so the
    target head runs once a step (the trainer's `label_source: target`).

    `compile_elementwise` (default: on CUDA) fuses each chunk's softmax / L1 / gradient passes."""
    B, T, _ = hidden_BTH.shape
    K = block_size
    N = T // K
    if compile_elementwise is None:
        compile_elementwise = hidden_BTH.device.type == "cuda"

    mask_BT = labels_BT != IGNORE_INDEX
    w_BT = slot_weights(K, gamma, hidden_BTH.device).repeat(N).unsqueeze(0) * mask_BT
    weighted, ce_n, l1_n, pred_n, tgt_n = fused_block_rows(
        _dspark_rows,
        (None, None, torch.long, torch.long),
        drop_anchor(hidden_BTH, K),
        lm_head_VH,
        target_logits_fn,
        drop_anchor(target_rows_BTH, K),
        drop_anchor(labels_BT, K),
        drop_anchor(w_BT.expand(B, T), K).to(torch.promote_types(hidden_BTH.dtype, torch.float32)),
        markov_NR=drop_anchor(markov_BTR, K),
        markov_w2_VR=markov_w2_VR,
        chunk_rows=chunk_rows,
        compiled=compile_elementwise,
        labels_from_target=labels_from_target,
    )

    def slots(x_BT: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B*N, K-1], dropping the anchor slot
        return x_BT.reshape(B * N, K)[:, 1:]

    ce_BT, l1_BT = unslot(ce_n, B, T, K), unslot(l1_n, B, T, K)
    per_slot_BT = DSPARK_CE_W * ce_BT + DSPARK_L1_W * l1_BT
    bce_BT = torch.zeros_like(ce_BT)
    numerator = weighted
    if confidence_BT is not None:
        bce_BT = _confidence_bce(confidence_BT, l1_BT)
        numerator = numerator + DSPARK_BCE_W * (bce_BT * w_BT).sum()
        per_slot_BT = per_slot_BT + DSPARK_BCE_W * bce_BT.detach()
    denominator = w_BT.sum().detach()

    match_BT = unslot(pred_n, B, T, K) == unslot(tgt_n, B, T, K)
    chain_ok = chain_ok_BN.reshape(-1)
    pos_mask = slots(mask_BT) & chain_ok.unsqueeze(1)
    loss_sum, loss_w = per_position(slots(per_slot_BT), pos_mask)
    correct, count = per_position(slots(match_BT), pos_mask)
    reach, chains = acceptance_from_matches(slots(match_BT), chain_ok)
    wd = w_BT.detach()
    extras = {"ce": (ce_BT * wd).sum(), "l1": (l1_BT * wd).sum(), "bce": (bce_BT.detach() * wd).sum()}
    return LossParts(
        numerator, denominator, loss_sum, loss_w, correct, count, reach, chains, extras, slots(match_BT)
    )


@dataclass
class DSparkCELoss:
    total: torch.Tensor
    ce: torch.Tensor
    confidence: torch.Tensor
    accuracy: torch.Tensor


def dspark_ce_loss(
    model: DSparkDraftModel,
    out: DSparkOutput,
    labels_BT: torch.Tensor,
    *,
    confidence_weight: float = 0.1,
    chunk_size: int = 4096,
    compile_elementwise: bool = False,
) -> DSparkCELoss:
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
    return DSparkCELoss(ce + confidence_weight * conf, ce, conf, hit_N.sum() / count)
