"""`builtin:magpie`: user turns the target writes itself (Magpie, arXiv 2406.08464), then answers.

A chat model trained on conversations continues its chat template's *pre-query text* (the render
of the conversation so far up to where the next user message's content begins) with a user
message. `pre_query_text` renders the history plus a sentinel user message through the target
tokenizer's own template (`data.chat_template_kwargs` and `data.system_prompt_policy` applied, as
every row of the run is rendered) and cuts at the sentinel. The target samples from there
(`data.magpie.temperature`, `top_p`) until an end-of-turn token (`template.eot_ids`); that text is
the user turn. For turn `t + 1` the history holds turn `t` and the target's answer to it
(sampled as regeneration samples: `data.regenerate_*`, its tokens per answer).

Where it runs: `data.prompts` / `data.sources` name `builtin:magpie`; `load_rows` gives placeholder
rows (`kind: "synth"`, `synth: {knobs, pool, index}`), and the regeneration child fills them
(`fill_rows`, with the engine it already runs) before the target answers every last user turn
through the ordinary regeneration path (`engine.regenerate.regenerate_rows`; the answers before it,
already the target's own, are kept: the row's `answered`). Every engine leader synthesizes the
same whole pool (the source's share of `data.num_samples`; same seeds, so the same rows) and
fills its own rows, so the filter sees the whole pool; user turns are short, the cost is small
next to the answers.

Determinism: candidate `i`'s turn `t` is sampled with its own vLLM request seed (`request_seed`),
so a candidate's text does not depend on the batch or on the pool size; `synth_filter.select`
keeps the first passing candidates in order. Over-generation: candidates are drawn in batches
until the pool is full, at most `ceil(pool * oversample)`; a pool still short fails the run in
one line (never fewer rows than asked).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hpctoolkit.data.config import MagpieConfig
from hpctoolkit.data.synth_filter import (
    Candidate,
    EvalIndex,
    Selection,
    answer_reason,
    eval_texts,
    select,
    turn_reason,
)
from hpctoolkit.data.template import ChatSpec, apply_system_policy, eot_ids, prompt_ids, render
from hpctoolkit.errors import ConfigError, DataIntegrityError

SOURCE = "builtin:magpie"
SENTINEL = "HPCTOOLKITMAGPIESENTINEL7c1e"
# A batch draws this much more than the survival rate so far says is missing, plus a few.
_MARGIN = 1.25


class SynthGenerate(Protocol):
    """`engine.regenerate.vllm_generator`'s `generate`, with per-call sampling overrides."""

    def __call__(
        self,
        prompts: list[list[int]],
        max_tokens: list[int],
        seeds: list[int],
        *,
        temperature: float | None = None,
        top_p: float | None = None,
        stop_token_ids: list[int] | None = None,
    ) -> list[tuple[list[int], str]]: ...


@dataclass(frozen=True)
class Limits:
    """What bounds a synthesized conversation: the answers' new tokens (`data.regenerate_tokens`),
    the longest history (`data.max_prompt_tokens`) and the engine's `max_model_len`."""

    answer_tokens: int
    max_prompt_tokens: int
    max_model_len: int


@dataclass(frozen=True)
class _Ctx:
    """What one synthesis run holds fixed."""

    tok: Any
    spec: ChatSpec
    generate: SynthGenerate
    limits: Limits
    evals: EvalIndex
    eot: set[int]


def placeholder_rows(n: int, knobs: MagpieConfig) -> list[dict[str, Any]]:
    """Rows 0..n-1 of a pool of `n`, to be written by the target (`fill_rows`)."""
    d = dataclasses.asdict(knobs)
    return [
        {
            "kind": "synth",
            "messages": [],
            "text": "",
            "input_ids": [],
            "loss_mask": [],
            "origin": f"{SOURCE}: row {i}",
            "synth": {**d, "pool": n, "index": i},
        }
        for i in range(n)
    ]


def request_seed(seed: int, index: int, turn: int, what: str) -> int:
    """The vLLM seed of candidate `index`'s turn `turn` (`what`: "user" or "answer"): distinct per
    request and per `seed`, below 2**56."""
    digest = hashlib.blake2b(f"{seed}:{index}:{turn}:{what}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


def pre_query_text(tok: Any, history: Sequence[dict[str, Any]], spec: ChatSpec) -> str:
    """The template's render of `history` and a user turn, up to where that turn's content begins."""
    msgs = apply_system_policy([*history, {"role": "user", "content": SENTINEL}], spec)
    text = render(tok, msgs, spec, add_generation_prompt=False)
    if text.count(SENTINEL) != 1:
        raise ConfigError(
            f"data.prompts={SOURCE}: the chat template writes a user message's content "
            f"{text.count(SENTINEL)} times, not once, so its pre-query text is unknown"
        )
    return text[: text.index(SENTINEL)]


def pre_query_ids(tok: Any, history: Sequence[dict[str, Any]], spec: ChatSpec) -> list[int]:
    return list(tok(pre_query_text(tok, history, spec), add_special_tokens=False).input_ids)


def messages(c: Candidate) -> list[dict[str, Any]]:
    """The candidate's conversation: user turns, each but the last followed by its answer."""
    out: list[dict[str, Any]] = []
    for k, turn in enumerate(c.turns):
        out.append({"role": "user", "content": turn})
        if k < len(c.answers):
            out.append({"role": "assistant", "content": c.answers[k]})
    return out


def _body(ids: Sequence[int], eot: set[int]) -> list[int]:
    body = list(ids)
    while body and body[-1] in eot:
        body.pop()
    return body


def _user_round(alive: list[Candidate], t: int, knobs: MagpieConfig, ctx: _Ctx) -> None:
    jobs = []
    for c in alive:
        p = pre_query_ids(ctx.tok, messages(c), ctx.spec)
        # Twice the longest turn: one that ends past it is told (too_long) from one that never ends.
        budget = min(2 * knobs.max_tokens + 1, ctx.limits.max_model_len - 1 - len(p))
        if len(p) > ctx.limits.max_prompt_tokens or budget <= knobs.min_tokens:
            c.reason = "too_long"
            continue
        jobs.append((c, p, budget))
    if not jobs:
        return
    outs = ctx.generate(
        [p for _, p, _ in jobs],
        [b for _, _, b in jobs],
        [request_seed(knobs.seed, c.index, t, "user") for c, _, _ in jobs],
        temperature=knobs.temperature,
        top_p=knobs.top_p,
        stop_token_ids=sorted(ctx.eot),
    )
    for (c, _, _), (ids, finish) in zip(jobs, outs, strict=True):
        body = _body(ids, ctx.eot)
        text = str(ctx.tok.decode(body, skip_special_tokens=True)).strip()
        c.turns.append(text)
        c.reason = turn_reason(finish == "stop", len(body), text, knobs.min_tokens, knobs.max_tokens)
        if not c.reason and ctx.evals.is_copy(text):
            c.reason = "eval_copy"


def _answer_prompt(c: Candidate, ctx: _Ctx) -> list[int] | None:
    """The prompt the target answers `c`'s last turn from, or None where it does not fit."""
    p = prompt_ids(ctx.tok, apply_system_policy(messages(c), ctx.spec), ctx.spec)
    fits = len(p) <= ctx.limits.max_prompt_tokens and len(p) < ctx.limits.max_model_len - 1
    return p if fits else None


def _answer_round(alive: list[Candidate], t: int, knobs: MagpieConfig, ctx: _Ctx) -> None:
    jobs = []
    for c in alive:
        p = _answer_prompt(c, ctx)
        if p is None:
            c.reason = "too_long"
            continue
        jobs.append((c, p, min(ctx.limits.answer_tokens, ctx.limits.max_model_len - 1 - len(p))))
    if not jobs:
        return
    outs = ctx.generate(
        [p for _, p, _ in jobs],
        [b for _, _, b in jobs],
        [request_seed(knobs.seed, c.index, t, "answer") for c, _, _ in jobs],
    )
    for (c, _, _), (ids, _) in zip(jobs, outs, strict=True):
        content = str(ctx.tok.decode(_body(ids, ctx.eot), skip_special_tokens=True))
        c.answers.append(content)
        c.reason = answer_reason(content)


def _run_batch(batch: list[Candidate], knobs: MagpieConfig, ctx: _Ctx) -> None:
    for t in range(knobs.turns):
        _user_round([c for c in batch if not c.reason], t, knobs, ctx)
        if t < knobs.turns - 1:
            _answer_round([c for c in batch if not c.reason], t, knobs, ctx)
    for c in batch:
        # Regeneration answers the last turn: its prompt must fit as every other row's does.
        if not c.reason and _answer_prompt(c, ctx) is None:
            c.reason = "too_long"


def synthesize(n: int, knobs: MagpieConfig, ctx: _Ctx) -> tuple[list[Candidate], Selection, int]:
    """The pool's `n` conversations, the selection, and how many candidates were drawn."""
    cap = math.ceil(n * knobs.oversample)
    cands: list[Candidate] = []
    while True:
        sel = select(cands, n, ctx.evals, knobs.near_dup)
        need = n - len(sel.kept)
        if need <= 0 or len(cands) >= cap:
            break
        # The next batch is sized by the share that survived so far (at worst 1 / oversample).
        rate = max(len(sel.kept) / len(cands), 1 / knobs.oversample) if cands else 1.0
        size = min(cap - len(cands), math.ceil(need / rate * _MARGIN) + 4)
        batch = [Candidate(i) for i in range(len(cands), len(cands) + size)]
        _run_batch(batch, knobs, ctx)
        cands += batch
    if len(sel.kept) < n:
        why = ", ".join(f"{k} {v}" for k, v in sel.dropped.items() if v)
        raise DataIntegrityError(
            f"data.prompts={SOURCE}: {len(sel.kept)} of {n} rows survived filtering after {len(cands)} "
            f"candidates (dropped: {why or 'none'}); raise data.magpie.oversample (now "
            f"{knobs.oversample:g}) or loosen data.magpie's length and duplicate bounds"
        )
    return [cands[p] for p in sel.kept], sel, len(cands)


def report_line(report: dict[str, Any]) -> str:
    dropped = ", ".join(f"{k} {v}" for k, v in report["dropped"].items() if v) or "none"
    line = (
        f"{SOURCE}: {report['rows']} rows of {report['turns']} user turn(s) kept of "
        f"{report['candidates']} candidates (dropped: {dropped}; checked against "
        f"{', '.join(report['eval_sets']) or 'no evaluation set'}) in {report['seconds']:.1f} s"
    )
    if report["eval_sets_missing"]:
        line += f"; WARNING: not installed, so not checked: {', '.join(report['eval_sets_missing'])}"
    return line


def fill_rows(
    rows: Sequence[dict[str, Any]], tok: Any, spec: ChatSpec, generate: SynthGenerate, limits: Limits
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """`rows` with each `builtin:magpie` placeholder replaced by its synthesized conversation
    (ending in a user turn; `answered`: the turns already answered), and the synthesis report
    (None when there was no placeholder)."""
    places = [k for k, r in enumerate(rows) if r["kind"] == "synth"]
    if not places:
        return list(rows), None
    head = dict(rows[places[0]]["synth"])
    n = int(head.pop("pool"))
    head.pop("index")
    knobs = MagpieConfig(**head)
    texts, missing = eval_texts()
    evals = EvalIndex([t for ts in texts.values() for t in ts], knobs.eval_overlap)
    ctx = _Ctx(tok, spec, generate, limits, evals, eot_ids(tok, spec.end_of_turn_tokens))
    t0 = time.monotonic()
    convs, sel, drawn = synthesize(n, knobs, ctx)
    out = list(rows)
    for k in places:
        c = convs[int(rows[k]["synth"]["index"])]
        out[k] = {
            "kind": "chat",
            "messages": messages(c),
            "text": "",
            "input_ids": [],
            "loss_mask": [],
            "origin": f"{rows[k]['origin']} (candidate {c.index})",
            "answered": knobs.turns - 1,
        }
    report = {
        "source": SOURCE,
        "rows": n,
        "turns": knobs.turns,
        "seed": knobs.seed,
        "candidates": drawn,
        "examined": sel.examined,
        "kept": len(sel.kept),
        "dropped": sel.dropped,
        "eval_sets": {name: len(ts) for name, ts in texts.items()},
        "eval_sets_missing": sorted(missing),
        "seconds": round(time.monotonic() - t0, 1),
    }
    return out, report
