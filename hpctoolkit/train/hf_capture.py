"""Capture target hidden states with transformers instead of the engine (evaluation and tests).

The states match the engine's capture convention: capture id `k` is transformers'
`hidden_states[k]` (0 = the embeddings, k = after layer k-1), and the last state is the final
norm's *input*, as vLLM captures it (transformers' own `hidden_states[-1]` is post-norm).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpctoolkit.train.synthetic import SyntheticSample


def _load(target_dir: str | os.PathLike, dtype: torch.dtype):
    # Here: transformers' auto classes take about a second to import, and only evaluation and the
    # tests load a whole target; importing the evaluation code must stay cheap.
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).eval()


@torch.no_grad()
def greedy_sequences(
    target_dir: str | os.PathLike, prompts: list[list[int]], max_new_tokens: int, *, dtype=torch.float32
) -> list[list[int]]:
    """Prompt + the target's greedy continuation, per prompt (one left-padded batch)."""
    model = _load(target_dir, dtype)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return [p + out[i, width:].tolist() for i, p in enumerate(prompts)]


@torch.no_grad()
def recapture(
    target_dir: str | os.PathLike, sequences: list[list[int]], capture_ids: list[int], *, dtype=torch.bfloat16
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence `(aux [n_aux, T, H], last_prenorm [T, H])`, fp32."""
    model = _load(target_dir, dtype)
    grabbed: dict[str, torch.Tensor] = {}
    hook = model.model.norm.register_forward_hook(lambda m, args, out: grabbed.__setitem__("last", args[0]))
    out = []
    try:
        for ids in sequences:
            res = model(torch.tensor([ids]), output_hidden_states=True)
            aux = torch.stack([res.hidden_states[i][0] for i in capture_ids])
            out.append((aux.float(), grabbed["last"][0].float()))
    finally:
        hook.remove()
    return out


@dataclass
class HFCaptureSamples:
    """A picklable `samples_source` factory over sequences captured with transformers.

    Computed once per process on first use; rank `r` of `w` takes sequences `i % w == r`.
    """

    target_dir: str
    sequences: list[list[int]]
    capture_ids: list[int]
    _cache: list[Any] = field(default_factory=list, repr=False)

    def samples(self) -> list[SyntheticSample]:
        if not self._cache:
            states = recapture(Path(self.target_dir), self.sequences, self.capture_ids)
            for i, (seq, (aux, last)) in enumerate(zip(self.sequences, states, strict=True)):
                self._cache.append(SyntheticSample(f"hf-{i}", torch.tensor(seq), aux, last))
        return self._cache

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": []}

    def __call__(self, rank: int, world_size: int, epoch: int, skip: int):
        return self.samples()[rank::world_size][skip:]
