# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Simulated acceptance: the trainer's own metric, on the tokens vLLM served.

The target is run once more in transformers over prompt + served output to recapture the hidden
states the engine would capture (aux layers); the *exported* draft (loaded back from the serving
checkpoint, with the target's embedding and head, as vLLM shares them) drafts
`num_speculative_tokens` tokens from every generated position, and a draft counts as accepted
while it matches the target's greedy token. Which chains those are is the family trainer's
`served_chains`.

The target's greedy token at a position is the token vLLM served there (`ServedTokens`): greedy
speculative decoding is lossless, so each served token is vLLM's own target argmax after the
served prefix, the very verdict its rejection sampler applied. Judged by the transformers pass's
argmax instead, a near-tie that pass's kernels break the other way (one token of 240 on the tiny
target, in bf16 and fp32 alike) flips a chain the engine never saw and shifts the replayed
schedule after it. The transformers pass gives the draft its context and the `k` greedy tokens
past the output (vLLM's last verifications reach there).

Two averages come out of those chains: `simulated` replays
vLLM's schedule (the first chain starts at the first generated token, each next one right after
the previous verification's bonus token), which is what the served number measures;
`simulated_uniform` averages over every start position, as the trainer's running metric does.
They differ when acceptance is uneven along a sequence: serving visits hard stretches once per
token and easy ones once per `k + 1` tokens.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from hpctoolkit.config.draft import draft_target_layer_ids
from hpctoolkit.config.precision import engine_dtype
from hpctoolkit.dtypes import torch_dtype
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.models.common.draft import DraftModel
from hpctoolkit.models.common.trainer import FamilyTrainer
from hpctoolkit.models.families import read_config_json
from hpctoolkit.models.registry import build_draft_model, load_draft_config, trainer_class_for
from hpctoolkit.train.build import init_from_target
from hpctoolkit.train.hf_capture import greedy_sequences, recapture
from hpctoolkit.train.metrics import StepStats
from hpctoolkit.train.target_head import TargetHead, read_target_tensor


def load_exported_draft(export_dir: str | os.PathLike, target_dir: str | os.PathLike):
    """The exported draft as our model, with what vLLM shares from the target filled in.

    Returns `(draft, target_head)`. Any parameter that is neither in the export nor shared from
    the target raises, the same fail-closed rule as the serving audit.
    """
    export_dir = Path(export_dir)
    config = load_draft_config(export_dir)
    draft = build_draft_model(config)
    state = load_file(str(export_dir / "model.safetensors"))
    head = TargetHead.from_pretrained(target_dir)
    pruned = config.draft_vocab_size < config.vocab_size
    if pruned:
        draft.set_vocab_mapping(state["d2t"].long() + torch.arange(config.draft_vocab_size))
    exported_head = state.get("lm_head.weight")
    init_from_target(draft, head, read_target_tensor(target_dir, "embed_tokens.weight"))
    missing, unexpected = draft.load_state_dict(state, strict=False)
    shared = {"embed_tokens.weight", "t2d", "d2t"} | ({"lm_head.weight"} if exported_head is None else set())
    really_missing = sorted(set(missing) - shared)
    if really_missing or unexpected:
        raise DataIntegrityError(
            f"export {export_dir} does not fit {type(draft).__name__}: missing {really_missing}, "
            f"unexpected {sorted(unexpected)}"
        )
    return draft.eval(), head


class ServedTokens(TargetHead):
    """A target head whose verdict at each row is a token id the row carries: `rows(seq)` puts
    `seq[t + 1]` at row `t`, and `logits` turns rows back into one-hot logits over the vocabulary.
    Trainers read the target only through `logits`, so they score the draft against `seq`."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(torch.zeros(vocab_size, 1), torch.ones(1), 0.0)

    @staticmethod
    def rows(seq: list[int]) -> torch.Tensor:
        """`[L, 1]` float ids (exact below 2**24): the token after each position (the last repeats)."""
        nxt = torch.tensor(seq[1:] + seq[-1:], dtype=torch.float32)
        return nxt.unsqueeze(-1)

    @torch.no_grad()
    def logits(self, last_NH: torch.Tensor, *, prenorm: bool) -> torch.Tensor:
        ids = last_NH[..., 0].round().long()
        return torch.nn.functional.one_hot(ids, self.vocab_size).float()


def replay_schedule(matches: torch.Tensor, first: int, last: int) -> list[int]:
    """Accepted drafts per verification when chains are visited as vLLM does.

    Start at chain `first`; a verification accepting `n` drafts plus the bonus token moves the
    next chain `n + 1` positions on; stop past chain `last` (the last with every draft defined).
    """
    accepted = []
    c = first
    while c <= last:
        n = int(torch.cumprod(matches[c].long(), 0).sum())
        accepted.append(n)
        c += n + 1
    return accepted


def _replay_summary(accepted: list[int], k: int) -> dict[str, Any]:
    v = len(accepted)
    return {
        "verifications": v,
        "acceptance_length_incl_bonus": 1.0 + sum(accepted) / v,
        "acc_len_excl_bonus": sum(accepted) / v,
        "acceptance_rate_per_pos": [sum(a > i for a in accepted) / v for i in range(k)],
    }


def _served_stats(
    trainer_cls: type[FamilyTrainer],
    draft: DraftModel,
    head: TargetHead,
    k: int,
    prompt: list[int],
    out: list[int],
    seq: list[int],
    aux: torch.Tensor,
) -> tuple[list[int], StepStats] | None:
    """One served request: accepted drafts per replayed verification, and the uniform stats."""
    P, M, L = len(prompt), len(out), len(seq)
    if M < 2:
        return None
    verdict = ServedTokens(head.vocab_size)
    chains = trainer_cls.served_chains(draft, verdict, k, P, M, L)
    context = aux.permute(1, 0, 2).reshape(1, L, -1)
    with torch.no_grad():
        parts = chains.trainer(
            torch.tensor([seq]),
            context,
            verdict.rows(seq).unsqueeze(0),
            chains.loss_mask_BS,
            torch.tensor([L]),
            last_prenorm=True,
            **chains.step,
        )
    stats = StepStats(parts.pos_count.numel(), tuple(parts.extras), parts.stats_vector())
    return replay_schedule(parts.chain_matches, chains.first, chains.last), stats


def simulate(
    export_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    prompts_token_ids: list[list[int]],
    outputs: list[list[int]],
    *,
    num_speculative_tokens: int,
    dtype: str = "auto",
) -> dict[str, Any]:
    """The trainer's simulated acceptance of the exported draft on prompt + served output.

    `dtype` is the engine's (`engine.dtype`; `auto` resolved as the engine resolves it): the
    hidden states are recaptured in the precision the served target ran in."""
    k = num_speculative_tokens
    draft, head = load_exported_draft(export_dir, target_dir)
    trainer_cls = trainer_class_for(load_draft_config(export_dir))
    layer_ids = draft_target_layer_ids(read_config_json(export_dir))
    if layer_ids is None:
        raise DataIntegrityError(f"export {export_dir} names no target layers in its config.json")
    hf_indices = [i + 1 for i in layer_ids]
    sequences = [p + o for p, o in zip(prompts_token_ids, outputs, strict=True)]
    # Both passes below run the target in the precision it was served in.
    served_dtype = torch_dtype(engine_dtype(dtype))
    # vLLM keeps verifying until the request holds max_tokens, so its last chains reach up to k
    # tokens past the output; extend each sequence greedily by k so those chains are defined.
    extended = greedy_sequences(target_dir, sequences, k, dtype=served_dtype)
    states = recapture(target_dir, extended, hf_indices, dtype=served_dtype)
    total = None
    replayed: list[int] = []
    for prompt, out, seq, (aux, _last) in zip(prompts_token_ids, outputs, extended, states, strict=True):
        got = _served_stats(trainer_cls, draft, head, k, prompt, out, seq, aux)
        if got is None:
            continue
        replayed += got[0]
        total = got[1] if total is None else total + got[1]
    if total is None or total.chains == 0 or not replayed:
        raise DataIntegrityError(
            f"no position of the served outputs leaves room for {k} drafts; raise max_tokens"
        )
    return {
        **_replay_summary(replayed, k),
        "uniform": {
            "acceptance_length_incl_bonus": total.acceptance_length_incl_bonus(k),
            "acc_len_excl_bonus": total.simulated_acc_len_excl_bonus(k),
            "acceptance_rate_per_pos": total.acceptance_rate_per_pos()[:k],
            "per_position_accuracy": total.pos_accuracy()[:k],
            "chains": total.chains,
        },
    }
