# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BTH), per STYLE.md
"""DFlash loss: decay-weighted cross-entropy over the masked slots of every block.

Slot `k` of a block (`k = 1..K-1`; slot 0 is the known anchor) gets weight `exp(-(k-1)/gamma)`:
early slots decide whether later ones are ever reached, so they matter more. `gamma` is the draft
config's `decay_gamma` (`dflash_decay_gamma` resolves 0 to the DFlash paper's value).

`dflash_loss` is what the trainer optimises (it returns `LossParts`, see `train.losses`);
`block_cross_entropy` is the plain mean CE of a block layout, without materialising `[B, T, V]`
logits (the model tests and benchmarks).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hpctoolkit.models.common.fused_ce import fused_linear_cross_entropy
from hpctoolkit.models.dflash.layout import IGNORE_INDEX
from hpctoolkit.train.losses import LossParts, acceptance_from_matches, chunked_rows, per_position

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
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def _ce_rows(
    h_NH: torch.Tensor, labels_N: torch.Tensor, w_VH: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(h_NH, w_VH).float()
    ce = F.cross_entropy(logits, labels_N, ignore_index=IGNORE_INDEX, reduction="none")
    return ce, logits.argmax(-1)


def dflash_loss(
    hidden_BTH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    labels_BT: torch.Tensor,
    target_ids_BT: torch.Tensor,
    chain_ok_BN: torch.Tensor,
    *,
    block_size: int,
    gamma: float,
) -> LossParts:
    """`labels_BT` are the CE targets (`IGNORE_INDEX` where unsupervised); `target_ids_BT` the
    target's greedy tokens, which accuracy and simulated acceptance are scored against."""
    B, T, _ = hidden_BTH.shape
    K = block_size
    N = T // K
    ce_N, pred_N = chunked_rows(_ce_rows, hidden_BTH.flatten(0, 1), labels_BT.flatten(), consts=(lm_head_VH,))
    mask_BT = labels_BT != IGNORE_INDEX
    w_BT = slot_weights(K, gamma, hidden_BTH.device).repeat(N).unsqueeze(0) * mask_BT
    numerator = (ce_N.view(B, T) * w_BT).sum()
    denominator = w_BT.sum().detach()

    def slots(x_BT: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B*N, K-1], dropping the anchor slot
        return x_BT.reshape(B * N, K)[:, 1:]

    match_BT = pred_N.view(B, T) == target_ids_BT
    chain_ok = chain_ok_BN.reshape(-1)
    pos_mask = slots(mask_BT) & chain_ok.unsqueeze(1)
    loss_sum, loss_w = per_position(slots(ce_N.view(B, T)), pos_mask)
    correct, count = per_position(slots(match_BT), pos_mask)
    reach, chains = acceptance_from_matches(slots(match_BT), chain_ok)
    return LossParts(
        numerator, denominator, loss_sum, loss_w, correct, count, reach, chains, chain_matches=slots(match_BT)
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
