"""Prompt sets: a deterministic builtin set for the tiny target, or a JSONL file.

A JSONL line is `{"text": "..."}` or `{"messages": [{"role": ..., "content": ...}, ...]}`; messages
go through the target tokenizer's chat template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.testing.tiny_target import CORPUS


def _builtin_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        # Lengths spread from a sentence to a few hundred tokens, so some prompts span several
        # prefill chunks.
        k = 1 + (i * 7) % 24
        texts.append(" ".join(rng.choice(CORPUS) for _ in range(k)))
    return texts


def _jsonl_texts(path: Path, tokenizer: Any) -> list[str]:
    if not path.is_file():
        raise ConfigError(f"data.prompts: {path} does not exist")
    texts = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"data.prompts: {path}:{lineno} is not valid JSON ({err.msg})") from err
        if "messages" in row:
            texts.append(tokenizer.apply_chat_template(row["messages"], tokenize=False))
        elif "text" in row:
            texts.append(str(row["text"]))
        else:
            raise ConfigError(f"data.prompts: {path}:{lineno} has neither 'text' nor 'messages'")
    return texts


def load_prompt_ids(
    spec: str, tokenizer: Any, num: int, max_tokens: int, *, seed: int = 0, offset: int = 0
) -> list[list[int]]:
    """`num` tokenised prompts (truncated to `max_tokens`), skipping the first `offset`."""
    if spec == "builtin:tiny":
        texts = _builtin_texts(num + offset, seed)
    elif spec.startswith("builtin:"):
        raise ConfigError(f"data.prompts: unknown builtin prompt set {spec!r}; known: ['builtin:tiny']")
    else:
        texts = _jsonl_texts(Path(spec), tokenizer)
    texts = texts[offset : offset + num]
    if len(texts) < num:
        raise ConfigError(f"data.prompts: {spec} holds {len(texts) + offset} prompts, {num + offset} needed")
    return [tokenizer(t, add_special_tokens=False).input_ids[:max_tokens] for t in texts]
