# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Eagle3 trainer: a test-time-training unroll of `ttt_length` steps.

Step 0 reads the projected target aux states at position `t` and the token at `t + 1`; step `i`
reads the draft's own pre-norm output of step `i - 1` and the token at `t + 1 + i`, at position
`t + i`. Every step is scored against the target distribution at `t + 1 + i` (its lm_head over
`last_hidden_states[t + 1 + i]`), i.e. the token at `t + 2 + i`. The steps share one KV cache:
step `i` at index `t` attends to step 0's keys at indices `<= t` (computed from target states)
and to steps `1 .. i` at index `t` only, which is what the served drafter's cache holds when it
drafts position `t + i` (`models.eagle3.model.ttt_mask`; tested against a token-by-token
serving-order forward).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from hpctoolkit.models.common.batch import Batch
from hpctoolkit.models.common.draft import DraftModel
from hpctoolkit.models.common.losses import LossParts, acceptance_from_matches, per_position
from hpctoolkit.models.common.trainer import FamilyTrainer, ServedChains, TargetLogits, TrainerOptions
from hpctoolkit.models.common.vocab import supervised_token_counts
from hpctoolkit.models.eagle3.loss import EAGLE3_STEP_DECAY, eagle3_step_loss, eagle3_target_side
from hpctoolkit.models.eagle3.model import Eagle3DraftModel, KVCache


def shift_left(x_BS: torch.Tensor, n: int) -> torch.Tensor:
    """`x[:, t + n]` (any trailing dims), zero-padded past the end."""
    out = torch.zeros_like(x_BS)
    if n < x_BS.shape[1]:
        out[:, : x_BS.shape[1] - n] = x_BS[:, n:]
    return out


class Eagle3Trainer(FamilyTrainer):
    family = "eagle3"
    unused_options = ("num_anchors", "label_source")
    prunes_vocab = True
    draft: Eagle3DraftModel

    @classmethod
    def served_chains(
        cls, draft: DraftModel, head: TargetLogits, k: int, prompt_len: int, out_len: int, seq_len: int
    ) -> ServedChains:
        """A `k`-step unroll; the chain for the bonus token at `a` starts at `t = a - 1`."""
        first, last = prompt_len - 1, prompt_len + out_len - 3
        t = torch.arange(seq_len)
        mask = ((t >= first) & (t <= last)).unsqueeze(0)
        # Eagle3 reads no seed, anchors or label source: only the unroll is the served one.
        opts = TrainerOptions(seed=0, ttt_length=k, num_anchors=0, label_source="target")
        return ServedChains(cls(draft, head, opts), mask, first, last)

    @property
    def num_positions(self) -> int:
        return self.cfg.ttt_length

    @property
    def pruned(self) -> bool:
        c = self.draft.config
        return c.draft_vocab_size < c.vocab_size

    def shard_units(self) -> list[nn.Module]:
        return [self.draft.midlayer]

    def draft_ids(self) -> torch.Tensor:
        """Target id of every draft token (empty when the vocabulary is not pruned)."""
        d2t = self.draft.d2t
        if not self.pruned:
            return torch.empty(0, dtype=torch.long, device=d2t.device)
        return d2t + torch.arange(d2t.numel(), device=d2t.device)

    def token_counts(self, samples: Iterable) -> torch.Tensor:
        counts = torch.zeros(self.draft.config.vocab_size, dtype=torch.float64)
        for s in samples:
            counts += supervised_token_counts(s, counts.numel())
        return counts

    def step_inputs(self, batch: Batch, step: int) -> dict[str, torch.Tensor]:
        return {"label_mask_BS": batch.supervised_BS}

    def forward(
        self,
        input_ids_BS: torch.Tensor,
        context_BSC: torch.Tensor,
        last_BSH: torch.Tensor,
        loss_mask_BS: torch.Tensor,
        lengths_B: torch.Tensor,
        *,
        last_prenorm: bool,
        label_mask_BS: torch.Tensor | None = None,
    ) -> LossParts:
        """`label_mask_BS` (the batch's supervised tokens; None: every token) keeps step `i` at
        position `t` only where its target token `t + 2 + i` is supervised."""
        B, S = input_ids_BS.shape
        P = self.num_positions
        pos_BS = torch.arange(S, device=input_ids_BS.device).expand(B, S)
        ids_V = self.draft_ids()
        lm_head = self.draft.lm_head.weight
        hidden_BSH = None
        numerator = lm_head.new_zeros((), dtype=torch.float32)
        denominator = torch.zeros((), dtype=torch.float64, device=input_ids_BS.device)
        kls, matches, sups = [], [], []
        kv_cache = KVCache()
        logp_t, argmax, inside = (
            x.unflatten(0, (B, S))
            for x in eagle3_target_side(
                lambda rows: self.target_logits(rows, last_prenorm), last_BSH.flatten(0, 1), ids_V
            )
        )
        for i in range(P):
            in_range_BS = (pos_BS + 1 + i < lengths_B.unsqueeze(1)) & loss_mask_BS
            if label_mask_BS is not None:
                in_range_BS = in_range_BS & shift_left(label_mask_BS, i + 2)
            out = self.draft(
                context_BSC if i == 0 else None,
                shift_left(input_ids_BS, i + 1),
                pos_BS + i,
                hidden_BSH=hidden_BSH,
                kv_cache=kv_cache,
            )
            kl_N, match_N, sup_N = eagle3_step_loss(
                out.hidden_BSH.flatten(0, 1),
                lm_head,
                shift_left(logp_t, i + 1).flatten(0, 1),
                shift_left(argmax, i + 1).flatten(),
                shift_left(inside, i + 1).flatten(),
                in_range_BS.flatten(),
                ids_V,
            )
            w = EAGLE3_STEP_DECAY**i
            numerator = numerator + w * kl_N.sum()
            denominator = denominator + w * sup_N.sum()
            kls.append(kl_N.detach())
            matches.append(match_N)
            sups.append(sup_N)
            hidden_BSH = out.prenorm_BSH
        kl_NP, match_NP, sup_NP = (torch.stack(x, dim=1) for x in (kls, matches, sups))
        chain_ok_BS = (pos_BS + P < lengths_B.unsqueeze(1)) & loss_mask_BS
        if label_mask_BS is not None:
            chain_ok_BS = chain_ok_BS & shift_left(label_mask_BS, 2)
        chain_ok_N = chain_ok_BS.flatten()
        loss_sum, loss_w = per_position(kl_NP, sup_NP)
        in_chain_NP = chain_ok_N.unsqueeze(1).expand_as(match_NP)
        correct, count = per_position(match_NP, in_chain_NP)
        reach, chains = acceptance_from_matches(match_NP, chain_ok_N)
        return LossParts(
            numerator, denominator, loss_sum, loss_w, correct, count, reach, chains, chain_matches=match_NP
        )
