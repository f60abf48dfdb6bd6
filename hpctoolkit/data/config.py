"""The recipe's `data` section: where the conversations come from, how they are rendered and
masked, and how the target regenerates their responses. See docs/data.md."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hpctoolkit.config.fields import (
    SEED_MAX,
    Choice,
    Float,
    Int,
    Kind,
    ListOf,
    Mapping,
    Nested,
    Path,
    Text,
    check_fields,
    require,
)
from hpctoolkit.errors import ConfigError

# The prompt sets built here rather than read from a file (`data.prompts` / `sources[i].path`).
BUILTIN_SOURCES = ("builtin:tiny", "builtin:chat", "builtin:magpie")
FORMATS = ("auto", "messages", "sharegpt", "text", "tokens")
SYSTEM_PROMPT_POLICIES = ("keep", "drop", "default", "replace")
LOSS_MASKS = ("assistant", "last_assistant", "all")
MASK_METHODS = ("auto", "template", "prefix")
MAX_MAGPIE_TURNS = 8
MAX_MAGPIE_TOKENS = 4096
MAX_OVERSAMPLE = 20.0


@dataclass
class DataSource:
    """One file of a mix: JSON, JSONL or Parquet; `weight` is its share of `num_samples`."""

    path: str = ""
    weight: float = 1.0
    # "auto" reads each row's own fields (messages / conversations / text / input_ids).
    format: str = "auto"

    KINDS: ClassVar[dict[str, Kind]] = {
        "path": Path(nonempty=True),
        "weight": Float(lo=0.0, lo_open=True, cap=1e9),
        "format": Choice(FORMATS),
    }


@dataclass
class MagpieConfig:
    """`builtin:magpie`: user turns the target writes itself from its chat template's pre-query
    text (Magpie), then answers through regeneration (`data.synth`; docs/data.md)."""

    # User turns a row has; each but the last is answered while synthesizing (data.regenerate_*).
    turns: int = 1
    # Sampling of the user turns.
    temperature: float = 1.0
    top_p: float = 1.0
    # Bounds of a user turn, in target tokens (shorter or longer ones are dropped).
    min_tokens: int = 4
    max_tokens: int = 256
    # Same seed, same rows (each candidate's requests have seeds of their own).
    seed: int = 0
    # At most ceil(rows * oversample) candidates are drawn to fill the pool after filtering.
    oversample: float = 2.0
    # Word 5-gram Jaccard at or above which a row is a near-duplicate of an earlier one.
    near_dup: float = 0.7
    # Word 5-gram containment at or above which a row is a copy of an evaluation question.
    eval_overlap: float = 0.5

    KINDS: ClassVar[dict[str, Kind]] = {
        # The ranges, with why, are validate()'s; the kinds keep out what no range check sees (nan).
        "turns": Int(),
        "temperature": Float(),
        "top_p": Float(),
        "min_tokens": Int(),
        "max_tokens": Int(),
        "seed": Int(0, SEED_MAX),
        "oversample": Float(),
        "near_dup": Float(),
        "eval_overlap": Float(),
    }

    def validate(self) -> None:
        check_fields(self, "magpie.")
        require(
            1 <= self.turns <= MAX_MAGPIE_TURNS,
            "magpie.turns",
            f"must lie in 1..{MAX_MAGPIE_TURNS}",
            self.turns,
        )
        require(
            0 < self.temperature <= 2,
            "magpie.temperature",
            "must lie in (0, 2] (the user turns are sampled; 0 would write one turn over and over)",
            self.temperature,
        )
        require(0 < self.top_p <= 1, "magpie.top_p", "must lie in (0, 1]", self.top_p)
        require(self.min_tokens >= 1, "magpie.min_tokens", "must be >= 1", self.min_tokens)
        require(
            self.min_tokens <= self.max_tokens <= MAX_MAGPIE_TOKENS,
            "magpie.max_tokens",
            f"must lie in magpie.min_tokens ({self.min_tokens})..{MAX_MAGPIE_TOKENS}",
            self.max_tokens,
        )
        require(self.seed >= 0, "magpie.seed", "must be >= 0", self.seed)
        require(
            1 <= self.oversample <= MAX_OVERSAMPLE,
            "magpie.oversample",
            f"must lie in [1, {MAX_OVERSAMPLE}]",
            self.oversample,
        )
        require(0 < self.near_dup <= 1, "magpie.near_dup", "must lie in (0, 1]", self.near_dup)
        require(0 < self.eval_overlap <= 1, "magpie.eval_overlap", "must lie in (0, 1]", self.eval_overlap)


@dataclass
class DataConfig:
    # "builtin:tiny" (plain text built locally), "builtin:chat" (chat prompts built locally; needs
    # regenerate_tokens), "builtin:magpie" (user turns the target writes, see `magpie`; needs
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
    # builtin:magpie's knobs.
    magpie: MagpieConfig = field(default_factory=MagpieConfig)

    KINDS: ClassVar[dict[str, Kind]] = {
        "prompts": Path(nonempty=True),
        "sources": ListOf(Nested()),
        "format": Choice(FORMATS),
        "num_samples": Int(1),
        "max_prompt_tokens": Int(1),
        "offline_dir": Path(),
        "chat_template_kwargs": Mapping("the target tokenizer's chat template"),
        "system_prompt_policy": Choice(SYSTEM_PROMPT_POLICIES),
        "system_prompt": Text(),
        "loss_mask": Choice(LOSS_MASKS),
        "mask_method": Choice(MASK_METHODS),
        "end_of_turn_tokens": ListOf(Text(nonempty=True)),
        "num_proc": Int(1, 1024),
        "shuffle_seed": Int(-1, SEED_MAX),
        "draft_vocab": Path(),
        "regenerate_tokens": Int(0),
        "regenerate_temperature": Float(0.0),
        "regenerate_top_p": Float(0.0, 1.0, lo_open=True),
        "regenerate_seed": Int(0, SEED_MAX),
        "regenerate_max_bad_fraction": Float(0.0, 1.0),
        "magpie": Nested(),
    }

    def validate(self) -> None:
        check_fields(self)
        paths = [s.path for s in self.sources] or [self.prompts]
        keys = [f"sources[{i}].path" for i in range(len(self.sources))] or ["prompts"]
        for key, path in zip(keys, paths, strict=True):
            require(
                not path.startswith("builtin:") or path in BUILTIN_SOURCES,
                key,
                f"names no builtin prompt set (valid names: {', '.join(BUILTIN_SOURCES)})",
                path,
            )
        for name in ("builtin:chat", "builtin:magpie"):
            if name in paths and not self.regenerate_tokens:
                raise ConfigError(
                    f"data.prompts: {name} holds prompts without answers; set data.regenerate_tokens "
                    "so that the target answers them"
                )
        require(paths.count("builtin:magpie") <= 1, "sources", "names builtin:magpie twice", paths)
        self.magpie.validate()
        if "builtin:magpie" not in paths and self.magpie != MagpieConfig():
            warnings.warn(
                "data.magpie is set but no data source is builtin:magpie: it has no effect", stacklevel=2
            )
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
