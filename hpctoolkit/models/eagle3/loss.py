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

from hpctoolkit.train.losses import chunked_rows

EAGLE3_STEP_DECAY = 0.8


def eagle3_step_loss(
    hidden_NH: torch.Tensor,
    lm_head_VH: torch.Tensor,
    target_logits_fn,
    target_rows_NH: torch.Tensor,
    in_range_N: torch.Tensor,
    draft_ids_V: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step: `(kl_N, match_N, supervised_N)`.

    `hidden_NH` are the draft's final-normed states, `lm_head_VH` its head over the draft
    vocabulary, `draft_ids_V` the target id of every draft token (ascending).
    `kl_N` is `KL(p_target || p_draft)` per row (graph; zero where not supervised), `match_N` is
    whether the draft's greedy token equals the target's, `supervised_N` the loss mask.
    """
    full_vocab = bool(draft_ids_V.numel() == 0)

    def rows(h_NH: torch.Tensor, t_NH: torch.Tensor, w_VH: torch.Tensor, ids_V: torch.Tensor):
        logp_d = F.log_softmax(F.linear(h_NH, w_VH).float(), dim=-1)
        tgt_full = target_logits_fn(t_NH)
        tgt_argmax = tgt_full.argmax(-1)
        if full_vocab:
            tgt = tgt_full
            inside = torch.ones_like(tgt_argmax, dtype=torch.bool)
            pred_target_id = logp_d.argmax(-1)
        else:
            tgt = tgt_full.index_select(-1, ids_V)
            inside = torch.isin(tgt_argmax, ids_V)
            pred_target_id = ids_V[logp_d.argmax(-1)]
        logp_t = F.log_softmax(tgt, dim=-1)
        kl = (logp_t.exp() * (logp_t - logp_d)).sum(-1)
        return kl, pred_target_id == tgt_argmax, inside

    kl_N, match_N, inside_N = chunked_rows(rows, hidden_NH, target_rows_NH, consts=(lm_head_VH, draft_ids_V))
    supervised_N = inside_N & in_range_N
    return kl_N * supervised_N, match_N & in_range_N, supervised_N
