# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Eagle3: forward KL from the target distribution to the draft's, per test-time step.

With a pruned draft vocabulary the target distribution is restricted to the draft's tokens and
renormalised; a position whose target argmax falls outside the draft vocabulary cannot be
drafted correctly at all, so it is masked out of the loss (it still counts as a rejection in
the simulated acceptance). Step `i` of the unroll is weighted `0.8**i`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hpctoolkit.models.common.losses import LOGIT_CHUNK_ROWS, chunked_rows

EAGLE3_STEP_DECAY = 0.8


def eagle3_target_side(
    target_logits_fn, target_rows_NH: torch.Tensor, draft_ids_V: torch.Tensor, chunk: int = LOGIT_CHUNK_ROWS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What every step needs of the target at each row, formed once per forward: `(logp_t_NV,
    argmax_N, inside_N)`, the target's log-probabilities over the draft vocabulary (renormalised
    there; the whole vocabulary when `draft_ids_V` is empty), its argmax over the whole
    vocabulary (a target id) and whether that argmax is a draft token. No graph: the target head
    is frozen. Step `i` of the unroll scores against row `t + 1 + i`, so the steps share one
    table shifted (the target's `[rows, V]` GEMM once a forward instead of twice a step)."""
    full_vocab = bool(draft_ids_V.numel() == 0)
    outs = []
    with torch.no_grad():
        for start in range(0, max(target_rows_NH.shape[0], 1), chunk):
            tgt_full = target_logits_fn(target_rows_NH[start : start + chunk])
            argmax = tgt_full.argmax(-1)
            if full_vocab:
                outs.append(
                    (F.log_softmax(tgt_full, dim=-1), argmax, torch.ones_like(argmax, dtype=torch.bool))
                )
            else:
                tgt = tgt_full.index_select(-1, draft_ids_V)
                outs.append((F.log_softmax(tgt, dim=-1), argmax, torch.isin(argmax, draft_ids_V)))
    logp, argmax, inside = (torch.cat(list(col)) for col in zip(*outs, strict=True))
    return logp, argmax, inside


def eagle3_step_loss(
    hidden_NH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    logp_t_NV: torch.Tensor,
    target_argmax_N: torch.Tensor,
    inside_N: torch.Tensor,
    in_range_N: torch.Tensor,
    draft_ids_V: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step: `(kl_N, match_N, supervised_N)`.

    `hidden_NH` are the draft's final-normed states, `lm_head_VH` its head over the draft
    vocabulary, `draft_ids_V` the target id of every draft token (ascending); the target's side
    of each row comes from `eagle3_target_side`.
    `kl_N` is `KL(p_target || p_draft)` per row (graph; zero where not supervised), `match_N` is
    whether the draft's greedy token equals the target's, `supervised_N` the loss mask.
    """
    full_vocab = bool(draft_ids_V.numel() == 0)

    def rows(h_NH: torch.Tensor, logp_t: torch.Tensor, w_VH: torch.Tensor, ids_V: torch.Tensor):
        logp_d = F.log_softmax(F.linear(h_NH, w_VH).float(), dim=-1)
        pred = logp_d.argmax(-1)
        pred_target_id = pred if full_vocab else ids_V[pred]
        kl = (logp_t.exp() * (logp_t - logp_d)).sum(-1)
        return kl, pred_target_id

    kl_N, pred_N = chunked_rows(rows, hidden_NH, logp_t_NV, consts=(lm_head_VH, draft_ids_V))
    supervised_N = inside_N & in_range_N
    return kl_N * supervised_N, (pred_N == target_argmax_N) & in_range_N, supervised_N
