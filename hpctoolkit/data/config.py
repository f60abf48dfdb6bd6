"""The recipe's `data` section: where the conversations come from, how they are rendered and
masked, and how the target regenerates their responses. See the README's "Training data"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hpctoolkit.config.fields import non_negative, one_of, positive, require
from hpctoolkit.errors import ConfigError

FORMATS = ("auto", "messages", "sharegpt", "text", "tokens")
SYSTEM_PROMPT_POLICIES = ("keep", "drop", "default", "replace")
LOSS_MASKS = ("assistant", "last_assistant", "all")
MASK_METHODS = ("auto", "template", "prefix")


@dataclass
class DataSource:
    """One file of a mix: JSON, JSONL or Parquet; `weight` is its share of `num_samples`."""

    path: str = ""
    weight: float = 1.0
    # "auto" reads each row's own fields (messages / conversations / text / input_ids).
    format: str = "auto"


@dataclass
class DataConfig:
    # "builtin:tiny" (plain text built locally), "builtin:chat" (chat prompts built locally; needs
    # regenerate_tokens), or one JSON/JSONL/Parquet file of rows:
    # {"messages": [{"role", "content"}, ...]} (OpenAI), {"conversations": [{"from", "value"},
    # ...]} (ShareGPT), {"text": ...}, or {"input_ids": [...], "loss_mask": [...]}.
    prompts: str = "builtin:tiny"
    # Several files mixed by weight; when set, `prompts` must stay at its default.
    sources: list[DataSource] = field(default_factory=list)
    # The format of `prompts` (sources name their own); "auto" reads it from each row.
    format: str = "auto"
    num_samples: int = 32
    # Longest prompt (text rows, and each regenerated turn's history); longer rows are cut to it.
    max_prompt_tokens: int = 512
    # Where the local run keeps the samples it read (offline shards, replayable); "" means
    # <output_dir>/shards.
    offline_dir: str = ""
    # Keyword arguments of the target tokenizer's chat template (e.g. {enable_thinking: false}).
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # System prompt policy: "keep" each row's own, none added (the default); "drop" every system
    # message; "default": add `system_prompt` where a row has none; "replace" every row's with it.
    system_prompt_policy: str = "keep"
    system_prompt: str = ""
    # Supervised tokens: every assistant turn's content and end-of-turn token, only the last
    # assistant turn's, or every token (plain-text rows are always "all").
    loss_mask: str = "assistant"
    # How the mask is derived: the template's {% generation %} markers (return_assistant_tokens_mask),
    # rendering prefixes of the conversation, or auto (markers when the template has them).
    mask_method: str = "auto"
    # Extra end-of-turn token strings (the tokenizer's eos and the usual chat ones are known).
    end_of_turn_tokens: list[str] = field(default_factory=list)
    # Worker processes for datasets' map (reading and tokenizing).
    num_proc: int = 1
    # Order of the mixed rows: shuffled with this seed (-1 keeps file order, one source after another).
    shuffle_seed: int = -1
    # Reuse an Eagle3 draft vocabulary saved by an earlier run (its train/draft_vocab.json).
    draft_vocab: str = ""
    # Regeneration: each assistant turn (or the response to a plain-text prompt) is replaced by the
    # target's own, turn by turn, up to this many new tokens. 0 captures the rows as they are.
    regenerate_tokens: int = 0
    regenerate_temperature: float = 0.0
    regenerate_top_p: float = 1.0
    regenerate_seed: int = 0
    # Fail the run when more than this fraction of samples had a turn that came back empty or
    # failed (those turns keep the dataset's own response, or none for plain text).
    regenerate_max_bad_fraction: float = 0.0

    def validate(self) -> None:
        positive(self, "num_samples", "max_prompt_tokens", "num_proc")
        non_negative(self, "regenerate_tokens")
        paths = [s.path for s in self.sources] or [self.prompts]
        if "builtin:chat" in paths and not self.regenerate_tokens:
            raise ConfigError(
                "data.prompts: builtin:chat holds prompts without answers; set data.regenerate_tokens "
                "so that the target answers them"
            )
        one_of(self, "format", FORMATS)
        one_of(self, "system_prompt_policy", SYSTEM_PROMPT_POLICIES)
        one_of(self, "loss_mask", LOSS_MASKS)
        one_of(self, "mask_method", MASK_METHODS)
        if self.system_prompt_policy in ("default", "replace"):
            require(
                bool(self.system_prompt),
                "system_prompt",
                f"must be set for system_prompt_policy={self.system_prompt_policy}",
                self.system_prompt,
            )
        require(
            self.regenerate_temperature >= 0,
            "regenerate_temperature",
            "must be >= 0",
            self.regenerate_temperature,
        )
        require(
            0 < self.regenerate_top_p <= 1, "regenerate_top_p", "must lie in (0, 1]", self.regenerate_top_p
        )
        require(
            0 <= self.regenerate_max_bad_fraction <= 1,
            "regenerate_max_bad_fraction",
            "must lie in [0, 1]",
            self.regenerate_max_bad_fraction,
        )
        if self.sources and self.prompts != DataConfig.prompts:
            raise ConfigError(f"sources and prompts={self.prompts!r} are both set; give one")
        for i, s in enumerate(self.sources):
            require(bool(s.path), f"sources[{i}].path", "must be set", s.path)
            require(s.weight > 0, f"sources[{i}].weight", "must be > 0", s.weight)
            require(s.format in FORMATS, f"sources[{i}].format", f"must be one of {list(FORMATS)}", s.format)
