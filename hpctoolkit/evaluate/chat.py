"""Chats served with speculative decoding, acceptance measured per set, per category and per turn.

Turn 1 is the user's first message rendered with the target tokenizer's chat template (with the
generation prompt); the answer is greedy and stops at the tokenizer's EOS or `max_tokens`. Turn 2
(MT-Bench's) renders [user 1, assistant: the turn-1 answer's text, user 2] the same way; a set of
one-turn chats (HumanEval's) stops after turn 1. Greedy speculative decoding is lossless, so the
turn-1 answer is the target's own. One engine serves every set; each turn of a set is one
`generate` call over all its questions (a full batch), and each output carries its own acceptance
histogram (vLLM's per-request spec-decode metrics): a (set, category, turn) group's counters are
its requests' summed, per-set, per-category, per-turn and overall acceptance are sums of those,
and the requests' counters must add up to what the engine counted (checked in `compare`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.evaluate.mt_bench import Question
from hpctoolkit.evaluate.serve import ServingSession, add_counters, counter_delta, model_len
from hpctoolkit.targets.resolve import read_config, text_config

# Questions served at once: all 80 of a turn in two waves, within the CPU KV cache.
MAX_NUM_SEQS = 40
DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """`messages` through the chat template with the generation prompt, as token ids."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def turn_messages(q: Question, answers: Sequence[str]) -> list[dict[str, str]]:
    """The chat that asks `q`'s turn `len(answers) + 1`: its earlier user turns, each followed by
    its answer, then the next user turn."""
    msgs: list[dict[str, str]] = []
    for user, answer in zip(q.turns, answers, strict=False):
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return [*msgs, {"role": "user", "content": q.turns[len(answers)]}]


def first_turn(q: Question) -> list[dict[str, str]]:
    return turn_messages(q, [])


def second_turn(q: Question, answer: str) -> list[dict[str, str]]:
    return turn_messages(q, [answer])


def num_turns(name: str, questions: Sequence[Question]) -> int:
    """The turns every question of set `name` has; a set mixing counts (or empty) is refused."""
    counts = sorted({len(q.turns) for q in questions})
    if len(counts) != 1 or counts[0] < 1:
        raise ConfigError(f"evaluation set {name} must hold questions of one turn count, got {counts}")
    return counts[0]


def acceptance_length(counters: Mapping[str, Any]) -> float | None:
    """1 + accepted / drafts (incl. the bonus token); None where nothing was drafted."""
    drafts = float(counters.get(DRAFTS, 0))
    return None if drafts <= 0 else 1.0 + float(counters.get(ACCEPTED, 0)) / drafts


def acceptance_by_group(calls: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Acceptance of calls tagged `category` and `turn` with their `counters`: overall, by category,
    by turn (each group's counters summed, then 1 + accepted / drafts), and the summed counters."""
    total = add_counters([c["counters"] for c in calls])

    def over(key: str) -> dict[str, float | None]:
        groups: dict[str, list[dict[str, Any]]] = {}
        for c in calls:
            groups.setdefault(str(c[key]), []).append(c["counters"])
        return {g: acceptance_length(add_counters(parts)) for g, parts in groups.items()}

    return {
        "overall": acceptance_length(total),
        "by_category": over("category"),
        "by_turn": over("turn"),
        "counters": total,
    }


def _context_limit(target_dir: Path) -> int | None:
    try:
        text = text_config(read_config(target_dir))
    except ConfigError:
        return None
    limit = text.get("max_position_embeddings")
    return int(limit) if isinstance(limit, int) else None


def serve_chats(
    export_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    sets: Mapping[str, Sequence[Question]],
    tokenizer: Any,
    *,
    num_speculative_tokens: int,
    max_tokens: int,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Serve every turn of every question of every set, in one engine (see the module docstring).

    Returns `method`, `engine_start_s`, `max_model_len`, `calls` (one per (set, category, turn):
    `set`, `category`, `turn`, `question_ids`, `prompts`, `outputs`, `answers` (the outputs' text),
    `counters` (its requests' summed), `request_counters` (each request's, in `prompts` order),
    `generate_s` (its share of the turn's batch)) and `counters`
    (what the engine counted over the whole session, which the calls' counters add up to).
    """
    if not sets:
        raise ConfigError("evaluate needs at least one evaluation set")
    empty = [name for name, questions in sets.items() if not questions]
    if empty:
        raise ConfigError(f"evaluate needs at least one question in every set; {empty} hold none")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"evaluate.prompts=mt_bench renders chats with the target's chat template; the tokenizer of "
            f"{target_dir} has none"
        )
    target_dir = Path(target_dir)
    k = num_speculative_tokens
    turns = {name: num_turns(name, questions) for name, questions in sets.items()}
    max_len = _chat_model_len(sets, turns, tokenizer, target_dir, max_tokens, k)
    calls: list[dict[str, Any]] = []
    with ServingSession(
        export_dir,
        target_dir,
        num_speculative_tokens=k,
        max_model_len=max_len,
        max_num_seqs=min(max(len(qs) for qs in sets.values()), MAX_NUM_SEQS),
        dtype=dtype,
    ) as session:
        for name, questions in sets.items():
            per_turn: dict[int, dict[str, Any]] = {}
            answers: list[list[str]] = [[] for _ in questions]
            for turn in range(1, turns[name] + 1):
                prompts = [
                    render(tokenizer, turn_messages(q, a)) for q, a in zip(questions, answers, strict=True)
                ]
                got = session.generate(prompts, max_tokens=max_tokens, ignore_eos=False)
                texts = [tokenizer.decode(out, skip_special_tokens=True) for out in got["outputs"]]
                answers = [[*a, t] for a, t in zip(answers, texts, strict=True)]
                per_turn[turn] = got | {"prompts": prompts, "answers": texts}
            calls += _calls_by_group(name, questions, per_turn)
        totals = counter_delta(session.counters(), session.start_counters)
    return {
        "method": session.method,
        "engine_start_s": session.engine_start_s,
        "max_model_len": max_len,
        "calls": calls,
        "counters": totals,
    }


def _chat_model_len(
    sets: Mapping[str, Sequence[Question]],
    turns: Mapping[str, int],
    tokenizer: Any,
    target_dir: Path,
    max_tokens: int,
    k: int,
) -> int:
    """The engine's `max_model_len`: room for the longest last-turn prompt and its answer, within
    the target's context; raises `ConfigError` when a set's chats cannot fit it."""
    # Room for the longest last-turn prompt: its template with empty answers, plus the answers
    # re-tokenized (twice max_tokens each: decoding and encoding again need not give the same count).
    longest, name = max(
        (len(render(tokenizer, turn_messages(q, [""] * (turns[s] - 1)))) + 2 * max_tokens * (turns[s] - 1), s)
        for s, questions in sets.items()
        for q in questions
    )
    max_len = model_len(longest, max_tokens, k)
    limit = _context_limit(target_dir)
    if limit is not None and max_len > limit:
        if longest + max_tokens + k > limit:
            raise ConfigError(
                f"evaluate.max_tokens={max_tokens}: {turns[name]} turn(s) of {name} may need "
                f"{longest + max_tokens + k} tokens, more than the target's {limit}; lower evaluate.max_tokens"
            )
        max_len = limit
    return max_len


def _calls_by_group(
    name: str, questions: Sequence[Question], per_turn: Mapping[int, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """One call per (category, turn) of set `name`, in the questions' category order: its questions'
    share of that turn's batch (prompts, outputs, answers, summed counters, share of the batch's time)."""
    calls: list[dict[str, Any]] = []
    for category in dict.fromkeys(q.category for q in questions):
        rows = [i for i, q in enumerate(questions) if q.category == category]
        for turn, got in per_turn.items():
            share = len(rows) / len(questions)  # the batch's time, split by questions
            calls.append(
                {
                    "set": name,
                    "category": category,
                    "turn": turn,
                    "question_ids": [questions[i].question_id for i in rows],
                    "prompts": [got["prompts"][i] for i in rows],
                    "outputs": [got["outputs"][i] for i in rows],
                    "answers": [got["answers"][i] for i in rows],
                    "counters": add_counters([got["request_counters"][i] for i in rows]),
                    # Each request's own, in `prompts` order: the replay is compared with these.
                    "request_counters": [got["request_counters"][i] for i in rows],
                    "generate_s": got["generate_s"] * share,
                }
            )
    return calls
