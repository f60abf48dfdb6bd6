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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hpctoolkit.models.common.fused_ce import fused_linear_cross_entropy
from hpctoolkit.models.dflash.layout import IGNORE_INDEX
from hpctoolkit.models.dflash.loss import slot_weights
from hpctoolkit.models.dspark.model import DSparkDraftModel, DSparkOutput
from hpctoolkit.train.losses import LOGIT_CHUNK_ROWS, LossParts, acceptance_from_matches, per_position

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
    """One chunk: `(sum_n w_n (0.1 ce_n + 0.9 l1_n), ce_N, l1_N, draft argmax, target argmax,
    d(that sum)/d z_NV)`. `z_NV` draft logits, `t_NV` target logits, `w_N` the slot weights.
    `labels_from_target`: each supervised row's label is the target's argmax (`t_NV`'s)."""
    acc = torch.promote_types(z_NV.dtype, torch.float32)  # fp32, or fp64 in the CPU tests
    z = z_NV.to(acc)
    t = t_NV.to(acc)
    tgt = t.argmax(-1)
    if labels_from_target:
        labels_N = torch.where(labels_N != IGNORE_INDEX, tgt, labels_N)
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
    return total, ce, l1, z.argmax(-1), tgt, (grad * w_N.unsqueeze(1)).to(grad_dtype)


_compiled_rows = None


def _rows_fn(compiled: bool):
    global _compiled_rows
    if not compiled:
        return _dspark_rows
    if _compiled_rows is None:
        _compiled_rows = torch.compile(_dspark_rows, dynamic=False)
    return _compiled_rows


def _even_chunks(n: int, target: int) -> list[slice]:
    """Row slices of (nearly) equal size <= target: one compiled shape, not a ragged tail."""
    pieces = max(1, math.ceil(n / target))
    size = math.ceil(n / pieces) if n else 0
    return [slice(i, min(i + size, n)) for i in range(0, n, size)] if n else []


class _FusedDSparkRows(torch.autograd.Function):
    """`(weighted CE+L1 sum, ce_N, l1_N, pred_N, tgt_N)` over rows; gradients formed in forward."""

    @staticmethod
    def forward(
        ctx, h_NH, m_NR, w_VH, w2_VR, t_NH, labels_N, weight_N, target_fn, chunk, compiled, from_target
    ):
        n = h_NH.shape[0]
        dev = h_NH.device
        acc = torch.promote_types(h_NH.dtype, torch.float32)
        need = (h_NH.requires_grad, m_NR.requires_grad, w_VH.requires_grad, w2_VR.requires_grad)
        g_h = torch.zeros_like(h_NH) if need[0] else None
        g_m = torch.zeros_like(m_NR) if need[1] else None
        g_w = torch.zeros_like(w_VH, dtype=acc) if need[2] else None
        g_w2 = torch.zeros_like(w2_VR, dtype=acc) if need[3] else None
        total = torch.zeros((), dtype=acc, device=dev)
        ce_N = torch.zeros(n, dtype=acc, device=dev)
        l1_N = torch.zeros_like(ce_N)
        pred_N = torch.zeros(n, dtype=torch.long, device=dev)
        tgt_N = torch.zeros_like(pred_N)
        rows = _rows_fn(compiled)
        for sl in _even_chunks(n, chunk):
            z = torch.addmm(F.linear(m_NR[sl], w2_VR), h_NH[sl], w_VH.t())
            t = target_fn(t_NH[sl])
            part, ce_N[sl], l1_N[sl], pred_N[sl], tgt_N[sl], grad = rows(
                z, t, labels_N[sl], weight_N[sl], h_NH.dtype, from_target
            )
            total += part
            del z, t
            if g_h is not None:
                g_h[sl] = grad @ w_VH
            if g_m is not None:
                g_m[sl] = grad @ w2_VR
            if g_w is not None:
                g_w += (grad.t() @ h_NH[sl]).to(acc)
            if g_w2 is not None:
                g_w2 += (grad.t() @ m_NR[sl]).to(acc)
        ctx.grads = (g_h, g_m, g_w, g_w2)
        ctx.dtypes = (h_NH.dtype, m_NR.dtype, w_VH.dtype, w2_VR.dtype)
        ctx.mark_non_differentiable(ce_N, l1_N, pred_N, tgt_N)
        return total, ce_N, l1_N, pred_N, tgt_N

    @staticmethod
    def backward(ctx, grad_total, *_unused):
        grads, ctx.grads = ctx.grads, None
        out = [
            None if g is None else (g * grad_total.to(g.dtype)).to(dt)
            for g, dt in zip(grads, ctx.dtypes, strict=True)
        ]
        return (*out, None, None, None, None, None, None, None)


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

    def drop_anchor(x_BT_: torch.Tensor) -> torch.Tensor:  # [B, T, ...] -> [B*N*(K-1), ...]
        return x_BT_.reshape(B, N, K, *x_BT_.shape[2:])[:, :, 1:].reshape(B * N * (K - 1), *x_BT_.shape[2:])

    mask_BT = labels_BT != IGNORE_INDEX
    w_BT = slot_weights(K, gamma, hidden_BTH.device).repeat(N).unsqueeze(0) * mask_BT
    weighted, ce_n, l1_n, pred_n, tgt_n = _FusedDSparkRows.apply(
        drop_anchor(hidden_BTH),
        drop_anchor(markov_BTR),
        lm_head_VH,
        markov_w2_VR,
        drop_anchor(target_rows_BTH),
        drop_anchor(labels_BT),
        drop_anchor(w_BT.expand(B, T)).to(torch.promote_types(hidden_BTH.dtype, torch.float32)),
        target_logits_fn,
        chunk_rows,
        compile_elementwise,
        labels_from_target,
    )

    def slots(x_BT: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B*N, K-1], dropping the anchor slot
        return x_BT.reshape(B * N, K)[:, 1:]

    def unslot(x_n: torch.Tensor) -> torch.Tensor:  # kept rows -> [B, T], zero at the anchor slot
        full = x_n.new_zeros(B * N, K)
        full[:, 1:] = x_n.view(B * N, K - 1)
        return full.view(B, T)

    ce_BT, l1_BT = unslot(ce_n), unslot(l1_n)
    per_slot_BT = DSPARK_CE_W * ce_BT + DSPARK_L1_W * l1_BT
    bce_BT = torch.zeros_like(ce_BT)
    numerator = weighted
    if confidence_BT is not None:
        bce_BT = _confidence_bce(confidence_BT, l1_BT)
        numerator = numerator + DSPARK_BCE_W * (bce_BT * w_BT).sum()
        per_slot_BT = per_slot_BT + DSPARK_BCE_W * bce_BT.detach()
    denominator = w_BT.sum().detach()

    match_BT = unslot(pred_n) == unslot(tgt_n)
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
