"""Served against simulated acceptance of an exported draft, on the same prompts and tokens.

Convention: `*_incl_bonus` counts the target's bonus token per verification (EAGLE, vLLM);
`*_excl_bonus` does not (TorchSpec's `simulated_acc_len`). Both are reported for both sides.
Served and (replayed) simulated should agree closely: they differ only by bf16 kernels (vLLM's
CPU attention and GEMMs against transformers' and ours), a few percent; a larger gap means the
trainer and the server disagree about the draft, a bug to find.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.evaluate.chat import acceptance_by_group, serve_chats
from hpctoolkit.evaluate.mt_bench import Question
from hpctoolkit.evaluate.serve import acceptance_from_counters, add_counters, serve
from hpctoolkit.evaluate.simulate import simulate
from hpctoolkit.output.figures import figure
from hpctoolkit.train.plot import plot_acceptance

CONVENTION = (
    "acceptance_length_incl_bonus = 1 + accepted drafts per verification (EAGLE / vLLM); "
    "acc_len_excl_bonus = accepted drafts per verification (TorchSpec simulated_acc_len); "
    "acceptance_length_gap = served on the replayed requests (served_acceptance_length_replayed_requests) "
    "- simulated (replayed) on them"
)
MT_BENCH_CONVENTION = (
    "; on MT-Bench: both turns of every question, each rendered with the target's chat template, "
    "answers greedy up to its EOS or max_tokens, turn 2 after the target's own turn-1 answer; "
    "vLLM's counters are summed over all requests (verifications, not questions, are averaged), "
    "per category and per turn over that group's requests"
)
SETS_CONVENTION = (
    "; per_set: every set served by the same engine the same way, the top-level figures being the "
    "headline set's (eval_set); human_eval: one turn, the problem's prompt in a request to solve it"
)
MT_BENCH = "mt_bench"


def _acceptance_keys(
    served: dict[str, Any], simulated: dict[str, Any], same: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The served and simulated figures every evaluation reports, both incl. the bonus token.

    `same`: vLLM's counters over exactly the requests the simulation replayed (default: `served`,
    when it replayed them all). The gap compares those, never two different sets of questions:
    per-question acceptance varies far more than served and replayed differ."""
    same = served if same is None else same
    return {
        "served_acceptance_length": served["acceptance_length_incl_bonus"],
        "served_acceptance_length_replayed_requests": same["acceptance_length_incl_bonus"],
        "simulated_acceptance_length": simulated["acceptance_length_incl_bonus"],
        "simulated_uniform_acceptance_length": simulated["uniform"]["acceptance_length_incl_bonus"],
        "acceptance_length_gap": same["acceptance_length_incl_bonus"]
        - simulated["acceptance_length_incl_bonus"],
        "served_replayed_per_position_acceptance": same["acceptance_rate_per_pos"],
    }


def evaluate(
    export_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    prompts_token_ids: list[list[int]],
    *,
    num_speculative_tokens: int,
    max_tokens: int,
    plot_path: str | os.PathLike | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Served and simulated acceptance of the exported draft on `prompts_token_ids`.

    Returns `served_acceptance_length`, `simulated_acceptance_length` (vLLM's schedule replayed)
    and `simulated_uniform_acceptance_length` (every start position), all incl. the bonus token;
    the `convention`; `served` / `simulated` blocks with both conventions and per-position
    rates; and `acceptance_length_gap` (served - simulated).
    """
    if not prompts_token_ids:
        raise ConfigError("evaluate needs at least one prompt")
    served = serve(
        export_dir,
        target_dir,
        prompts_token_ids,
        num_speculative_tokens=num_speculative_tokens,
        max_tokens=max_tokens,
        dtype=dtype,
    )
    outputs = served.pop("outputs")
    simulated = simulate(
        export_dir,
        target_dir,
        prompts_token_ids,
        outputs,
        num_speculative_tokens=num_speculative_tokens,
        dtype=dtype,
    )
    result = {
        "eval_set": "held_out",
        **_acceptance_keys(served, simulated),
        "convention": CONVENTION,
        "num_speculative_tokens": num_speculative_tokens,
        "num_prompts": len(prompts_token_ids),
        "max_tokens": max_tokens,
        "served_per_position_acceptance": served["acceptance_rate_per_pos"],
        "simulated_per_position_acceptance": simulated["acceptance_rate_per_pos"],
        "served": served,
        "simulated": simulated,
    }
    if plot_path is not None:
        result["plot"] = _plot(result, served, simulated, plot_path, num_speculative_tokens)
    return result


def evaluate_mt_bench(
    export_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    questions: Sequence[Question],
    tokenizer: Any,
    *,
    num_speculative_tokens: int,
    max_tokens: int,
    plot_path: str | os.PathLike | None = None,
    simulate_per_category: int | None = None,
    dtype: str = "auto",
    more_sets: Mapping[str, Sequence[Question]] | None = None,
) -> dict[str, Any]:
    """`evaluate_sets` with MT-Bench's two-turn `questions` the headline, then `more_sets` (e.g.
    `human_eval`) served by the same engine and reported under `per_set` only."""
    sets = {MT_BENCH: questions, **(more_sets or {})}
    if len(sets) != 1 + len(more_sets or {}):
        raise ConfigError(f"more_sets may not name {MT_BENCH} again, the headline set")
    return evaluate_sets(
        export_dir,
        target_dir,
        sets,
        tokenizer,
        num_speculative_tokens=num_speculative_tokens,
        max_tokens=max_tokens,
        plot_path=plot_path,
        simulate_per_category=simulate_per_category,
        dtype=dtype,
    )


def evaluate_sets(
    export_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    sets: Mapping[str, Sequence[Question]],
    tokenizer: Any,
    *,
    num_speculative_tokens: int,
    max_tokens: int,
    plot_path: str | os.PathLike | None = None,
    simulate_per_category: int | None = None,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Served and simulated acceptance of the exported draft on the chat `sets` (name: questions).

    The first set is the headline (MT-Bench's two-turn questions wherever it is served): the
    held-out result's keys, plus `eval_set` (its name), `num_questions`,
    `served_acceptance_by_category` and `served_acceptance_by_turn` ("1", "2") are its figures, and
    the simulation replays the (prompt, served output) pairs of every turn of the first
    `simulate_per_category` served questions of each of its categories (all when None). `per_set`
    holds every set's served figures, the headline's too: `num_questions`, `num_turns`,
    `served_acceptance_length`, `..._by_category`, `..._by_turn`, `counters`, `answers`,
    `answers_stopped_at_eos`. `served` is the headline's, except `calls` (one per (set, category,
    turn) with its counters and acceptance) and `engine_counters`, which cover the whole session.
    """
    k = num_speculative_tokens
    run = serve_chats(
        export_dir,
        target_dir,
        sets,
        tokenizer,
        num_speculative_tokens=k,
        max_tokens=max_tokens,
        dtype=dtype,
    )
    calls = run["calls"]
    headline = next(iter(sets))
    mine = [c for c in calls if c["set"] == headline]
    groups = acceptance_by_group(mine)
    served = _served_block(run, groups, k)
    # The replay: every headline call's first `simulate_per_category` questions (all by default).
    n = simulate_per_category
    prompts = [p for c in mine for p in c["prompts"][:n]]
    outputs = [o for c in mine for o in c["outputs"][:n]]
    simulated = simulate(export_dir, target_dir, prompts, outputs, num_speculative_tokens=k, dtype=dtype)
    simulated["num_sequences"] = len(prompts)
    # vLLM's own counters over those same requests: what the replay is compared with.
    same = acceptance_from_counters(add_counters([r for c in mine for r in c["request_counters"][:n]]), k)
    served["calls"] = [_call_summary(c, tokenizer.eos_token_id) for c in calls]
    per_set = {name: _set_summary(name, qs, served["calls"]) for name, qs in sets.items()}
    result = {
        "eval_set": headline,
        "num_questions": len(sets[headline]),
        "categories": list(groups["by_category"]),
        **_acceptance_keys(served, simulated, same),
        "served_acceptance_by_category": groups["by_category"],
        "served_acceptance_by_turn": groups["by_turn"],
        "per_set": per_set,
        "convention": CONVENTION + MT_BENCH_CONVENTION + (SETS_CONVENTION if len(sets) > 1 else ""),
        "num_speculative_tokens": k,
        "max_tokens": max_tokens,
        "answers": per_set[headline]["answers"],
        "answers_stopped_at_eos": per_set[headline]["answers_stopped_at_eos"],
        "served_per_position_acceptance": served["acceptance_rate_per_pos"],
        "simulated_per_position_acceptance": simulated["acceptance_rate_per_pos"],
        "served": served,
        "simulated": simulated,
    }
    if plot_path is not None:
        result["plot"] = _plot(result, served, simulated, plot_path, k)
    return result


def _set_summary(
    name: str, questions: Sequence[Question], calls: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """One set's served figures, from its calls' summaries (`_call_summary`)."""
    mine = [c for c in calls if c["set"] == name]
    groups = acceptance_by_group(mine)
    return {
        "num_questions": len(questions),
        "num_turns": len(groups["by_turn"]),
        "served_acceptance_length": groups["overall"],
        "served_acceptance_by_category": groups["by_category"],
        "served_acceptance_by_turn": groups["by_turn"],
        "counters": groups["counters"],
        "answers": sum(len(c["output_tokens"]) for c in mine),
        "answers_stopped_at_eos": sum(c["stopped_at_eos"] for c in mine),
    }


def _served_block(run: dict[str, Any], groups: dict[str, Any], k: int) -> dict[str, Any]:
    """The served block: the headline set's acceptance (`groups`); every call's counters must add
    up to the engine's over the session."""
    calls = run["calls"]
    session = add_counters([c["counters"] for c in calls])
    served = {
        "method": run["method"],
        "engine_start_s": run["engine_start_s"],
        "generate_s": sum(c["generate_s"] for c in calls),
        "max_model_len": run["max_model_len"],
        "counters": groups["counters"],
        "engine_counters": run["counters"],
        "unloaded_parameters": [],
        **acceptance_from_counters(groups["counters"], k),
    }
    if session != run["counters"]:
        raise DataIntegrityError(
            f"vLLM's spec-decode counters over the session ({run['counters']}) are not the sum of its "
            f"calls' ({session}); a call's counters were read before they were complete"
        )
    return served


def _call_summary(c: dict[str, Any], eos: int | None) -> dict[str, Any]:
    """One (set, category, turn) call as the result reports it: its acceptance, counters and lengths."""
    return {
        "set": c["set"],
        "category": c["category"],
        "turn": c["turn"],
        "question_ids": c["question_ids"],
        "acceptance_length_incl_bonus": acceptance_by_group([c])["overall"],
        "counters": c["counters"],
        "generate_s": c["generate_s"],
        "prompt_tokens": [len(p) for p in c["prompts"]],
        "output_tokens": [len(o) for o in c["outputs"]],
        "stopped_at_eos": sum(bool(o) and o[-1] == eos for o in c["outputs"]),
        "answers": c["answers"],
    }


def _plot(
    result: dict[str, Any],
    served: dict[str, Any],
    simulated: dict[str, Any],
    plot_path: str | os.PathLike,
    k: int,
) -> str:
    return str(
        plot_acceptance(
            Path(plot_path),
            acceptance_rate_per_pos=simulated["acceptance_rate_per_pos"],
            accuracy_per_pos=simulated["uniform"]["per_position_accuracy"],
            served_rate_per_pos=served["acceptance_rate_per_pos"],
            rate_label="simulated, vLLM schedule replayed",
            accuracy_label="simulated accuracy, every start",
            title=(
                f"served {figure(result['served_acceptance_length'], 2)} vs simulated "
                f"{figure(result['simulated_acceptance_length'], 2)} (incl. bonus, k={k})"
            ),
        )
    )
