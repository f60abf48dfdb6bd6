"""The run's samples: rows read (`formats`), mixed by weight, rendered and masked (`template`).

`load_rows(cfg, num)` gives the first `num` normalised rows of the mix; `encode_row` turns one
into `{"input_ids", "loss_mask"}`; `load_samples` does both (tokenization runs as a `datasets`
map over the file, so it is cached and runs on `data.num_proc` processes). A builtin set
(`builtin:tiny`) is plain text built locally; `builtin:chat` (`data.builtin_chat`) is chat prompts
built locally, which the target answers (regeneration); `builtin:magpie` (`data.synth`) is placeholder
rows whose user turns the target writes itself in the regeneration child.

Mixing: source `i` of weight `w_i` contributes `round(num * w_i / sum(w))` rows (largest
remainder, ties to the earlier source), its first ones; a source with fewer rows is an error.
The mixed rows keep source order, or are shuffled with `data.shuffle_seed`.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hpctoolkit.data.config import BUILTIN_SOURCES, DataConfig, DataSource
from hpctoolkit.data.template import ChatSpec, encode_chat, prompt_ids
from hpctoolkit.errors import ConfigError
from hpctoolkit.targets.builtin import CORPUS


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    origin: str = ""

    @property
    def supervised(self) -> int:
        return sum(self.loss_mask)


def _builtin_texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    texts = []
    for i in range(n):
        # Lengths spread from a sentence to a few hundred tokens, so some prompts span several
        # prefill chunks.
        k = 1 + (i * 7) % 24
        texts.append(" ".join(rng.choice(CORPUS) for _ in range(k)))
    return texts


def chat_spec(cfg: DataConfig) -> ChatSpec:
    return ChatSpec(
        template_kwargs=dict(cfg.chat_template_kwargs),
        loss_mask=cfg.loss_mask,
        mask_method=cfg.mask_method,
        end_of_turn_tokens=tuple(cfg.end_of_turn_tokens),
        system_prompt_policy=cfg.system_prompt_policy,
        system_prompt=cfg.system_prompt,
    )


def regenerate_sampling(cfg: DataConfig) -> dict[str, Any]:
    """`engine.regenerate.Sampling`'s fields from the recipe's `data.regenerate_*`."""
    return {
        "max_new_tokens": cfg.regenerate_tokens,
        "temperature": cfg.regenerate_temperature,
        "top_p": cfg.regenerate_top_p,
        "seed": cfg.regenerate_seed,
    }


def sources_of(cfg: DataConfig) -> list[DataSource]:
    if cfg.sources:
        return list(cfg.sources)
    return [DataSource(path=cfg.prompts, weight=1.0, format=cfg.format)]


def shares(weights: Sequence[float], num: int) -> list[int]:
    """Largest-remainder split of `num` by `weights` (ties to the earlier source)."""
    total = float(sum(weights))
    exact = [num * w / total for w in weights]
    out = [int(x) for x in exact]
    order = sorted(range(len(weights)), key=lambda i: (-(exact[i] - out[i]), i))
    for i in order[: num - sum(out)]:
        out[i] += 1
    return out


def _source_rows(src: DataSource, n: int, cfg: DataConfig, seed: int) -> Any:
    """The first `n` normalised rows of one source: a list (builtin) or a `datasets.Dataset`."""
    if src.path.startswith("builtin:"):
        if src.path not in BUILTIN_SOURCES:
            raise ConfigError(
                f"data.prompts: unknown builtin prompt set {src.path!r}; known: {list(BUILTIN_SOURCES)}"
            )
        if src.path == "builtin:chat":
            from hpctoolkit.data.builtin_chat import chat_rows

            return chat_rows(n, seed)
        if src.path == "builtin:magpie":
            from hpctoolkit.data.synth import placeholder_rows

            # Its seed is its own (data.magpie.seed); a pool of this source's share.
            return placeholder_rows(n, cfg.magpie)
        return [
            {
                "kind": "text",
                "messages": [],
                "text": t,
                "input_ids": [],
                "loss_mask": [],
                "origin": f"{src.path}: row {i}",
            }
            for i, t in enumerate(_builtin_texts(n, seed))
        ]
    from hpctoolkit.data.formats import load_rows as read_file

    ds = read_file(src.path, src.format, num_proc=cfg.num_proc)
    if len(ds) < n:
        raise ConfigError(
            f"data: {src.path} holds {len(ds)} rows, {n} needed (its share of data.num_samples)"
        )
    return ds.select(range(n))


def _mixed(parts: list[list[Any]], cfg: DataConfig) -> list[Any]:
    rows = [r for part in parts for r in part]
    if cfg.shuffle_seed >= 0:
        random.Random(cfg.shuffle_seed).shuffle(rows)
    return rows


def load_rows(cfg: DataConfig, num: int, *, offset: int = 0, seed: int = 0) -> list[dict[str, Any]]:
    """Rows `offset .. offset + num` of the mix, normalised (not tokenized)."""
    srcs = sources_of(cfg)
    counts = shares([s.weight for s in srcs], num + offset)
    parts = [list(_source_rows(s, n, cfg, seed)) if n else [] for s, n in zip(srcs, counts, strict=True)]
    return _mixed(parts, cfg)[offset : offset + num]


def row_key(row: dict[str, Any]) -> str:
    """What identifies a normalised row's content: the first 16 hex digits of the SHA-256 of its
    fields as canonical JSON, without `origin` (where it came from is not what it says). The sample
    ledger keeps it beside each trained prompt index (`rundir.ledger`), so a resume sees an index
    that now holds another prompt."""
    fields = {k: v for k, v in row.items() if k != "origin"}
    text = json.dumps(fields, sort_keys=True, ensure_ascii=False, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def row_keys(cfg: DataConfig, num: int) -> list[str]:
    """`row_key` of each of the first `num` rows of the mix (in prompt-index order)."""
    return [row_key(dict(r)) for r in load_rows(cfg, num)]


def _clean(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    # Arrow gives every message every key; a template tests `is defined`, so drop the empty ones.
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _refuse_unsynthesized(row: dict[str, Any]) -> None:
    if row["kind"] == "synth":
        raise ConfigError(
            f"data: {row.get('origin', '')}: the target writes this row while regenerating; it has "
            "no text before (set data.regenerate_tokens; evaluate with evaluate.prompts=mt_bench)"
        )


def encode_row(row: dict[str, Any], tok: Any, spec: ChatSpec, max_tokens: int) -> Encoded:
    """One normalised row -> ids and mask, cut to `max_tokens`. Raises naming the row."""
    origin = row.get("origin", "")
    kind = row["kind"]
    _refuse_unsynthesized(row)
    if kind == "chat":
        msgs = _clean(row["messages"])
        try:
            ids, mask = encode_chat(tok, msgs, spec)
        except ConfigError as err:
            raise ConfigError(f"data: {origin}: {err}") from None
        if not any(mask):
            raise ConfigError(
                f"data: {origin}: field 'messages' has no assistant turn to supervise "
                "(set data.regenerate_tokens to have the target answer it)"
            )
    elif kind == "text":
        ids = list(tok(row["text"], add_special_tokens=False).input_ids)
        mask = [1] * len(ids)
    elif kind == "tokens":
        ids, mask = list(row["input_ids"]), list(row["loss_mask"])
        vocab = len(tok)
        bad = next((t for t in ids if t >= vocab), None)
        if bad is not None:
            raise ConfigError(
                f"data: {origin}: field 'input_ids' holds {bad}, outside the vocabulary ({vocab})"
            )
    else:
        raise ConfigError(f"data: {origin}: unknown row kind {kind!r}")
    if not ids:
        raise ConfigError(f"data: {origin}: renders to no tokens")
    return Encoded(ids[:max_tokens], mask[:max_tokens], origin)


def _encode_batch(
    batch: dict[str, list[Any]], tok: Any, spec: ChatSpec, max_tokens: int
) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {"input_ids": [], "loss_mask": [], "origin": []}
    for j in range(len(batch["kind"])):
        e = encode_row({k: batch[k][j] for k in batch}, tok, spec, max_tokens)
        out["input_ids"].append(e.input_ids)
        out["loss_mask"].append(e.loss_mask)
        out["origin"].append(e.origin)
    return out


def load_samples(cfg: DataConfig, tok: Any, num: int, *, offset: int = 0, seed: int = 0) -> list[Encoded]:
    """`num` encoded samples of the mix (no regeneration), skipping the first `offset`."""
    spec = chat_spec(cfg)
    srcs = sources_of(cfg)
    counts = shares([s.weight for s in srcs], num + offset)
    parts: list[list[Encoded]] = []
    for s, n in zip(srcs, counts, strict=True):
        rows = _source_rows(s, n, cfg, seed) if n else []
        if isinstance(rows, list):
            parts.append([encode_row(r, tok, spec, cfg.max_prompt_tokens) for r in rows])
            continue
        enc = rows.map(
            _encode_batch,
            batched=True,
            fn_kwargs={"tok": tok, "spec": spec, "max_tokens": cfg.max_prompt_tokens},
            remove_columns=rows.column_names,
            num_proc=cfg.num_proc if cfg.num_proc > 1 and len(rows) > 1 else None,
        )
        parts.append([Encoded(list(r["input_ids"]), list(r["loss_mask"]), r["origin"]) for r in enc])
    return _mixed(parts, cfg)[offset : offset + num]


def row_prompt_ids(row: dict[str, Any], tok: Any, spec: ChatSpec, max_tokens: int) -> list[int]:
    """What the target should answer for a row: the history before its last assistant turn (or the
    whole conversation) with the generation prompt; a text row as it is."""
    _refuse_unsynthesized(row)
    if row["kind"] == "chat":
        msgs = _clean(row["messages"])
        last = max((i for i, m in enumerate(msgs) if m["role"] == "assistant"), default=len(msgs))
        from hpctoolkit.data.template import apply_system_policy

        return prompt_ids(tok, apply_system_policy(msgs[:last] or msgs, spec), spec)[:max_tokens]
    if row["kind"] == "tokens":
        return list(row["input_ids"])[:max_tokens]
    return list(tok(row["text"], add_special_tokens=False).input_ids)[:max_tokens]


def load_prompt_ids(
    spec: str, tokenizer: Any, num: int, max_tokens: int, *, seed: int = 0, offset: int = 0
) -> list[list[int]]:
    """`num` prompts of one source (truncated to `max_tokens`), skipping the first `offset`: what the
    target is asked (evaluation)."""
    cfg = DataConfig(prompts=spec)
    rows = load_rows(cfg, num, offset=offset, seed=seed)
    if len(rows) < num:
        raise ConfigError(f"data.prompts: {spec} holds {len(rows) + offset} prompts, {num + offset} needed")
    return [row_prompt_ids(r, tokenizer, chat_spec(cfg), max_tokens) for r in rows]


def check_rows(cfg: DataConfig, held_out: int = 0) -> int:
    """At submission, before anything starts: every data file the run reads is read and each of its
    rows normalised (`formats.normalise_row`: the first bad one is named by file and row), and each
    holds the rows the run takes from it: its share of `data.num_samples`, and for `data.prompts`
    also `held_out` rows after them (the held-out evaluation's). Returns the file rows checked.
    Rows are not tokenized here: that needs the target's tokenizer (the run's first step does it)."""
    from hpctoolkit.data.formats import load_rows as read_file

    srcs = sources_of(cfg)
    counts = shares([s.weight for s in srcs], cfg.num_samples)
    checked = 0
    for i, (src, n) in enumerate(zip(srcs, counts, strict=True)):
        if src.path.startswith("builtin:"):
            continue
        key = f"data.sources[{i}].path" if cfg.sources else "data.prompts"
        extra = 0 if cfg.sources else held_out
        ds = read_file(src.path, src.format, num_proc=cfg.num_proc)
        checked += len(ds)
        if len(ds) < n + extra:
            why = f"{n} for data.num_samples={cfg.num_samples}" + (
                "" if not cfg.sources else f" (its share of weight {src.weight:g})"
            )
            if extra:
                why += f" + {extra} held out after them for the evaluation (evaluate.num_prompts)"
            raise ConfigError(f"{key}: {src.path} holds {len(ds)} rows; the run needs {n + extra}: {why}")
    return checked
