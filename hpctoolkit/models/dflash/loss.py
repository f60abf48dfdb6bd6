# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BTH), per STYLE.md
"""DFlash loss: decay-weighted cross-entropy over the masked slots of every block.

Slot `k` of a block (`k = 1..K-1`; slot 0 is the known anchor) gets weight `exp(-(k-1)/gamma)`:
early slots decide whether later ones are ever reached, so they matter more. `gamma` is the draft
config's `decay_gamma` (`dflash_decay_gamma` resolves 0 to the DFlash paper's value).

`dflash_loss` is what the trainer optimises (it returns `LossParts`, see `models.common.losses`);
`block_cross_entropy` is the plain mean CE of a block layout, without materialising `[B, T, V]`
logits (the model tests and benchmarks).
"""

from __future__ import annotations

import math

import torch

from hpctoolkit.models.common.fused_ce import fused_linear_cross_entropy
from hpctoolkit.models.common.fused_rows import drop_anchor, fused_block_rows, row_targets
from hpctoolkit.models.common.losses import LOGIT_CHUNK_ROWS, LossParts, acceptance_from_matches, per_position
from hpctoolkit.models.dflash.layout import IGNORE_INDEX

# gamma by block size, from the DFlash paper's training recipe.
_PAPER_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def dflash_decay_gamma(block_size: int, configured: float = 0.0) -> float:
    """The slot decay: the config's `decay_gamma` when positive, else the paper's for `block_size`."""
    if configured > 0:
        return configured
    return _PAPER_GAMMA.get(block_size, block_size / 2)


def slot_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """`[K]`: 0 for the anchor slot, `exp(-(k-1)/gamma)` for `k >= 1`."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    # `torch.where`, not `w[0] = 0.0`: that assignment copies a host scalar, which on CUDA waits
    # for the stream to drain.
    return torch.where(k > 0, torch.exp(-(k - 1) / gamma), 0.0)


def _dflash_rows(
    z_NV: torch.Tensor,
    t_NV: torch.Tensor,
    labels_N: torch.Tensor,
    w_N: torch.Tensor,
    grad_dtype: torch.dtype,
    labels_from_target: bool = False,
):
    """One chunk: `(sum_n w_n ce_n, (ce_N, draft argmax, target argmax), d(that sum)/d z_NV)`.
    `z_NV` draft logits, `t_NV` target logits (only their argmax is used), `w_N` the slot weights.
    `labels_from_target`: each supervised row's label is the target's argmax."""
    z = z_NV.to(torch.promote_types(z_NV.dtype, torch.float32))  # fp32, or fp64 in the CPU tests
    tgt, labels_N = row_targets(t_NV, labels_N, labels_from_target)
    valid = labels_N != IGNORE_INDEX
    safe = labels_N.clamp(min=0).unsqueeze(1)
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    ce = (lse.squeeze(1) - z.gather(1, safe).squeeze(1)) * valid
    # d ce / dz = softmax(z) - onehot(label)
    grad = torch.exp(z - lse).scatter_add(1, safe, -torch.ones_like(lse))
    weight = (w_N * valid).unsqueeze(1)
    return (w_N * ce).sum(), (ce, z.argmax(-1), tgt), (grad * weight).to(grad_dtype)


def dflash_loss(
    hidden_BTH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    target_logits_fn,
    target_rows_BTH: torch.Tensor,
    labels_BT: torch.Tensor,
    chain_ok_BN: torch.Tensor,
    *,
    block_size: int,
    gamma: float,
    chunk_rows: int = LOGIT_CHUNK_ROWS,
    compile_elementwise: bool | None = None,
    labels_from_target: bool = False,
) -> LossParts:
    """Decay-weighted CE of the draft logits `hidden @ lm_head.T` at every slot but the anchors.

    `target_logits_fn(rows_NH) -> [N, V]` (no grad) gives the target's logits at each slot from
    `target_rows_BTH` (the target's last state one position before the slot): accuracy and
    simulated acceptance are scored against their argmax. `labels_BT` are the CE targets
    (`IGNORE_INDEX` where unsupervised); with `labels_from_target` they only mark the supervised
    slots and each one's label is that argmax (the trainer's `label_source: target`), so the target
    head runs once a step, on the scored rows only.

    Fused with the vocabulary GEMMs (`common.fused_rows`): each chunk's draft logits are formed
    once and the CE gradient with them; `compile_elementwise` (default: on CUDA) fuses the chunk's
    softmax and gradient passes."""
    B, T, _ = hidden_BTH.shape
    K = block_size
    N = T // K
    if compile_elementwise is None:
        compile_elementwise = hidden_BTH.device.type == "cuda"
    mask_BT = labels_BT != IGNORE_INDEX
    w_BT = slot_weights(K, gamma, hidden_BTH.device).repeat(N).unsqueeze(0) * mask_BT
    numerator, ce_n, pred_n, tgt_n = fused_block_rows(
        _dflash_rows,
        (None, torch.long, torch.long),
        drop_anchor(hidden_BTH, K),
        lm_head_VH,
        target_logits_fn,
        drop_anchor(target_rows_BTH, K),
        drop_anchor(labels_BT, K),
        drop_anchor(w_BT.expand(B, T), K).to(torch.promote_types(hidden_BTH.dtype, torch.float32)),
        chunk_rows=chunk_rows,
        compiled=compile_elementwise,
        labels_from_target=labels_from_target,
    )
    denominator = w_BT.sum().detach()

    # Per chain (block) and draft position: the rows come back in [B*N, K-1] order.
    match_NP = (pred_n == tgt_n).view(B * N, K - 1)
    chain_ok = chain_ok_BN.reshape(-1)
    pos_mask = mask_BT.reshape(B * N, K)[:, 1:] & chain_ok.unsqueeze(1)
    loss_sum, loss_w = per_position(ce_n.view(B * N, K - 1), pos_mask)
    correct, count = per_position(match_NP, pos_mask)
    reach, chains = acceptance_from_matches(match_NP, chain_ok)
    return LossParts(
        numerator, denominator, loss_sum, loss_w, correct, count, reach, chains, chain_matches=match_NP
    )


def decay_table(block_size: int, gamma: float) -> list[float]:
    """The per-slot weights as plain floats (logged once, so runs are self-describing)."""
    return [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]


def block_cross_entropy(
    hidden_BTH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    chunk_size: int = 4096,
    compile_elementwise: bool = False,
) -> torch.Tensor:
    """Mean CE against `BlockLayout.labels`, without materialising `[B, T, V]` logits."""
    loss, _ = fused_linear_cross_entropy(
        hidden_BTH.flatten(0, 1),
        lm_head_weight_VH,
        labels_BT.flatten(),
        chunk_size=chunk_size,
        compile_elementwise=compile_elementwise,
    )
    return loss
