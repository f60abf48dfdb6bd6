"""Self-distillation data: extend each prompt with the target's own greedy continuation.

A draft is judged on the target's own outputs, so it should be trained on them: captured hidden
states of prompt + target response teach it what the verifier will accept. Runs the target in
vLLM (in this process, so call it from a child process of its own).
"""

from __future__ import annotations

import os
from pathlib import Path

from hpctoolkit.errors import DataIntegrityError


def regenerate(
    target_dir: str | os.PathLike, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """`prompt + greedy continuation` (up to `max_new_tokens`, stopping at EOS) for each prompt."""
    import torch

    from hpctoolkit.engine.env import engine_env

    backend = "cuda" if torch.cuda.is_available() else "cpu"
    for k, v in engine_env(backend, in_process=True, world_size=1, cpu_kvcache_space_gb=1).items():
        os.environ.setdefault(k, v)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(p) for p in prompts)
    llm = LLM(
        model=str(Path(target_dir)),
        enforce_eager=True,
        max_model_len=64 * ((longest + max_new_tokens + 64) // 64),
        max_num_seqs=16,
        enable_prefix_caching=False,
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    extended = [list(p) + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs, strict=True)]
    if any(len(e) == len(p) for e, p in zip(extended, prompts, strict=True)):
        raise DataIntegrityError("the target generated no tokens for some prompts; nothing to distil")
    return extended
