"""Two-turn chat served with speculative decoding, acceptance measured per category and per turn.

Turn 1 is the user's first message rendered with the target tokenizer's chat template (with the
generation prompt); the answer is greedy and stops at the tokenizer's EOS or `max_tokens`. Turn 2
renders [user 1, assistant: the turn-1 answer's text, user 2] the same way. Greedy speculative
decoding is lossless, so the turn-1 answer is the target's own. One engine serves every call; each
turn is one `generate` call over every question (a full batch), and each output carries its own
acceptance histogram (vLLM's per-request spec-decode metrics): a (category, turn) group's counters
are its requests' summed, per-category, per-turn and overall acceptance are sums of those, and the
requests' counters must add up to what the engine counted (checked in `compare`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.evaluate.mt_bench import Question
from hpctoolkit.evaluate.serve import ServingSession, add_counters, counter_delta, model_len

# Questions served at once: all 80 of a turn in two waves, within the CPU KV cache.
MAX_NUM_SEQS = 40
DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def render(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """`messages` through the chat template with the generation prompt, as token ids."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def first_turn(q: Question) -> list[dict[str, str]]:
    return [{"role": "user", "content": q.turns[0]}]


def second_turn(q: Question, answer: str) -> list[dict[str, str]]:
    return [*first_turn(q), {"role": "assistant", "content": answer}, {"role": "user", "content": q.turns[1]}]


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
        raw = json.loads((target_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    limit = raw.get("max_position_embeddings")
    return int(limit) if isinstance(limit, int) else None


def serve_two_turn(
    export_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    questions: Sequence[Question],
    tokenizer: Any,
    *,
    num_speculative_tokens: int,
    max_tokens: int,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Serve every question's two turns (see the module docstring).

    Returns `method`, `engine_start_s`, `max_model_len`, `calls` (one per (category, turn):
    `category`, `turn`, `question_ids`, `prompts`, `outputs`, `answers` (the outputs' text),
    `counters` (its requests' summed), `generate_s` (its share of the turn's batch)) and `counters`
    (what the engine counted over the whole session, which the calls' counters add up to).
    """
    if not questions:
        raise ConfigError("evaluate needs at least one MT-Bench question")
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"evaluate.prompts=mt_bench renders chats with the target's chat template; the tokenizer of "
            f"{target_dir} has none"
        )
    target_dir = Path(target_dir)
    k = num_speculative_tokens
    max_len = _two_turn_model_len(questions, tokenizer, target_dir, max_tokens, k)
    per_turn: dict[int, dict[str, Any]] = {}
    answers = [""] * len(questions)
    with ServingSession(
        export_dir,
        target_dir,
        num_speculative_tokens=k,
        max_model_len=max_len,
        max_num_seqs=min(len(questions), MAX_NUM_SEQS),
        dtype=dtype,
    ) as session:
        for turn in (1, 2):
            if turn == 1:
                prompts = [render(tokenizer, first_turn(q)) for q in questions]
            else:
                prompts = [
                    render(tokenizer, second_turn(q, a)) for q, a in zip(questions, answers, strict=True)
                ]
            got = session.generate(prompts, max_tokens=max_tokens, ignore_eos=False)
            answers = [tokenizer.decode(out, skip_special_tokens=True) for out in got["outputs"]]
            per_turn[turn] = got | {"prompts": prompts, "answers": answers}
        totals = counter_delta(session.counters(), session.start_counters)
    return {
        "method": session.method,
        "engine_start_s": session.engine_start_s,
        "max_model_len": max_len,
        "calls": _calls_by_group(questions, per_turn),
        "counters": totals,
    }


def _two_turn_model_len(
    questions: Sequence[Question], tokenizer: Any, target_dir: Path, max_tokens: int, k: int
) -> int:
    """The engine's `max_model_len`: room for the longest turn-2 prompt and its answer, within the
    target's context; raises `ConfigError` when two turns cannot fit it."""
    # Room for the longest turn-2 prompt: its template with an empty answer, plus the answer
    # re-tokenized (twice max_tokens: decoding and encoding again need not give the same count).
    longest = max(len(render(tokenizer, second_turn(q, ""))) for q in questions) + 2 * max_tokens
    max_len = model_len(longest, max_tokens, k)
    limit = _context_limit(target_dir)
    if limit is not None and max_len > limit:
        if longest + max_tokens + k > limit:
            raise ConfigError(
                f"evaluate.max_tokens={max_tokens}: two MT-Bench turns may need {longest + max_tokens + k} "
                f"tokens, more than the target's {limit}; lower evaluate.max_tokens"
            )
        max_len = limit
    return max_len


def _calls_by_group(
    questions: Sequence[Question], per_turn: Mapping[int, Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """One call per (category, turn), in the questions' category order: its questions' share of
    that turn's batch (prompts, outputs, answers, summed counters, share of the batch's time)."""
    calls: list[dict[str, Any]] = []
    for category in dict.fromkeys(q.category for q in questions):
        rows = [i for i, q in enumerate(questions) if q.category == category]
        for turn in (1, 2):
            got = per_turn[turn]
            share = len(rows) / len(questions)  # the batch's time, split by questions
            calls.append(
                {
                    "category": category,
                    "turn": turn,
                    "question_ids": [questions[i].question_id for i in rows],
                    "prompts": [got["prompts"][i] for i in rows],
                    "outputs": [got["outputs"][i] for i in rows],
                    "answers": [got["answers"][i] for i in rows],
                    "counters": add_counters([got["request_counters"][i] for i in rows]),
                    "generate_s": got["generate_s"] * share,
                }
            )
    return calls
