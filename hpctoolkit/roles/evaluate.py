"""The `evaluate` role: serve the exported draft with the target in vLLM and measure acceptance on
`evaluate.prompts`: `held_out` (the data.prompts rows after the run's `data.num_samples`) or
`mt_bench`: the chat sets of `evaluate.sets` (MT-Bench's two-turn questions, per category and
turn; HumanEval's one-turn problems), one engine for all, each set's figure under `per_set`.

It runs once the trainers ended cleanly, on every backend: the local launcher starts it, a batch
script runs it as its last step on trainer rank 0's node (one GPU), and under submitit the task of
trainer rank 0 runs it in a fresh process (`evaluate_in_fresh_process`). It writes `evaluate.json`,
merges the same figures into `summary.json` and, as the run's last role, points `latest` at the run
(`roles.results`). Dry (`HPCTOOLKIT_NODE_DRY`) whenever the trainers are: there is no export.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpctoolkit.errors import RoleFailedError
from hpctoolkit.evaluate.command import k_warning, serve_argv, serve_line
from hpctoolkit.output.console import speaker
from hpctoolkit.output.figures import figure
from hpctoolkit.plan.placement import ROLE_TRAINER
from hpctoolkit.roles.context import NodeContext, load_context
from hpctoolkit.roles.dry import dry_now
from hpctoolkit.roles.results import finished, trainer_acceptance_line
from hpctoolkit.rundir.atomic import read_json, write_json_atomic
from hpctoolkit.rundir.progress import Counted, count_line, write_progress
from hpctoolkit.rundir.summary import merge_summary, phase_fields

# What summary.json carries of a chat-set result, with `per_set` (the rest stays under "evaluate").
MT_BENCH_HEADLINE = (
    "eval_set",
    "num_questions",
    "served_acceptance_length",
    "served_acceptance_by_category",
    "served_acceptance_by_turn",
    "simulated_acceptance_length",
    "served_acceptance_length_replayed_requests",
    "acceptance_length_gap",
    "convention",
    "num_speculative_tokens",
    "max_tokens",
)


say = speaker("evaluate")


def not_served_reason(draft_config: str) -> str | None:
    """Why vLLM on this machine cannot serve this draft family, or None."""
    from hpctoolkit.engine.env import cuda_visible
    from hpctoolkit.models.families import serving_for

    return None if cuda_visible() else serving_for(draft_config).cpu_unservable


def _served(ctx: NodeContext, total: int, what: str) -> Counted:
    """`on_done(n)` for `evaluate.serve.reporting`: questions served, reported at a steady interval
    (`evaluate.progress_every_s`, and at the last) as a line and `progress/evaluate.json`."""

    def emit(record: dict[str, Any]) -> None:
        say(count_line(record))
        write_progress(ctx.run.progress("evaluate"), record)
        if record["done"] >= record["total"]:
            say("served; replaying the served requests in transformers for the simulated figure ...")

    return Counted("evaluate", what, total, ctx.cfg.evaluate.progress_every_s, emit)


def _held_out(ctx: NodeContext, export_dir: str, target_dir: Path, tok: Any) -> dict[str, Any]:
    from hpctoolkit.data.prompts import load_prompt_ids
    from hpctoolkit.evaluate import evaluate
    from hpctoolkit.evaluate.serve import reporting

    cfg = ctx.cfg
    prompts = load_prompt_ids(
        cfg.data.prompts,
        tok,
        cfg.evaluate.num_prompts,
        cfg.data.max_prompt_tokens,
        offset=cfg.data.num_samples,
    )
    if list(cfg.evaluate.sets) != ["mt_bench"]:
        say(f"warning: evaluate.sets={list(cfg.evaluate.sets)} has no effect with evaluate.prompts=held_out")
    say(f"serving the exported draft with the target in vLLM on {len(prompts)} held-out prompts ...")
    with reporting(_served(ctx, len(prompts), "questions")):
        ev = evaluate(
            export_dir,
            target_dir,
            prompts,
            num_speculative_tokens=cfg.evaluate.num_speculative_tokens,
            max_tokens=cfg.evaluate.max_tokens,
            dtype=cfg.engine.dtype,
        )
    return {
        "eval_set": "held_out",
        "served_acceptance_length": ev.get("served_acceptance_length"),
        "evaluate": ev,
    }


def _mt_bench(ctx: NodeContext, export_dir: str, target_dir: Path, tok: Any) -> dict[str, Any]:
    from hpctoolkit.evaluate import compare
    from hpctoolkit.evaluate.chat import num_turns
    from hpctoolkit.evaluate.serve import reporting
    from hpctoolkit.evaluate.sets import load_sets, set_lines

    cfg = ctx.cfg
    sets = load_sets(cfg.evaluate.sets, cfg.evaluate.questions_per_category)
    listed = ", ".join(f"{len(qs)} {name}" for name, qs in sets.items())
    say(f"serving the exported draft with the target in vLLM on {listed} questions ...")
    kw: dict[str, Any] = {
        "num_speculative_tokens": cfg.evaluate.num_speculative_tokens,
        "max_tokens": cfg.evaluate.max_tokens,
        "simulate_per_category": cfg.evaluate.simulate_per_category,
        "dtype": cfg.engine.dtype,
    }
    turns = sum(len(qs) * num_turns(name, qs) for name, qs in sets.items())
    with reporting(_served(ctx, turns, "question turns")):
        if "mt_bench" in sets:  # the headline, as before evaluate.sets
            mt = sets.pop("mt_bench")
            if sets:
                kw["more_sets"] = sets
            ev = compare.evaluate_mt_bench(export_dir, target_dir, mt, tok, **kw)
        else:
            ev = compare.evaluate_sets(export_dir, target_dir, sets, tok, **kw)
    say(
        f"by category: {_by(ev['served_acceptance_by_category'])}; by turn: {_by(ev['served_acceptance_by_turn'])}"
    )
    per_set = ev.get("per_set", {})  # every set's served figure, the headline's too
    for line in set_lines(per_set):
        say(line)
    return {k: ev[k] for k in MT_BENCH_HEADLINE} | {"per_set": per_set, "evaluate": ev}


def _by(groups: object) -> str:
    """`writing 1.500, roleplay 1.250`: a figure per group, rounded."""
    if not isinstance(groups, Mapping):
        return figure(groups)
    return ", ".join(f"{g} {figure(v)}" for g, v in groups.items())


def figures_line(ev: Mapping[str, Any], summary: Mapping[str, Any]) -> str:
    """Every acceptance figure of the run on one line, each with its convention and k: served
    (vLLM's counters), replayed against served on the same requests, and the trainer's."""
    k = ev.get("num_speculative_tokens")
    n = (ev.get("simulated") or {}).get("num_sequences", ev.get("num_prompts"))
    return (
        f"served acceptance length {figure(ev.get('served_acceptance_length'))} at k={k} on {ev.get('eval_set')} "
        f"(vLLM's counters, incl. bonus); replayed {figure(ev.get('simulated_acceptance_length'))} against served "
        f"{figure(ev.get('served_acceptance_length_replayed_requests'))} on the same {n} requests (gap "
        f"{figure(ev.get('acceptance_length_gap'))}); " + trainer_acceptance_line(summary)
    )


def run_evaluate(ctx: NodeContext) -> int:
    if ROLE_TRAINER in dry_now():
        say(f"dry: the trainers are dry, so there is no export to serve (on {ctx.nodename})")
        return 0
    from transformers import AutoTokenizer

    from hpctoolkit.models.families import serving_for
    from hpctoolkit.targets.resolve import display_name, resolve_target

    t0 = time.monotonic()
    cfg = ctx.cfg
    summary = read_json(ctx.run.summary)
    if not isinstance(summary, dict):
        raise RoleFailedError(
            f"evaluate: {ctx.run.summary} is missing, so the trainers of run {ctx.run_id} did not finish; "
            "there is no export to serve"
        )
    export_dir = summary.get("export_dir") or str(ctx.run.export)
    reason = not_served_reason(cfg.draft.config)
    result: dict[str, Any] = {
        "target": display_name(cfg.paths.target_model),
        "eval_set": cfg.evaluate.prompts,
    }
    if reason:
        say(f"not serving: {reason}")
        result |= {"served_acceptance_length": None, "served_acceptance_skipped": reason}
    else:
        warning = k_warning(
            cfg.draft.config, cfg.evaluate.num_speculative_tokens, ttt_length=cfg.training.ttt_length
        )
        if warning:
            say(f"warning: {warning}")
            result["served_k_warning"] = warning
        target_dir = resolve_target(cfg.paths.target_model)
        tok = AutoTokenizer.from_pretrained(target_dir)
        run = _mt_bench if cfg.evaluate.prompts == "mt_bench" else _held_out
        result |= run(ctx, export_dir, target_dir, tok)
        say(figures_line(result["evaluate"], summary))
        # The same draft outside hpctoolkit: what a user runs to serve it.
        method = serving_for(cfg.draft.config).vllm_method  # the recipe's family: what export wrote
        argv = serve_argv(
            export_dir, target_dir, method=method, num_speculative_tokens=cfg.evaluate.num_speculative_tokens
        )
        result["serve_command"] = serve_line(argv)
        say(f"serve it with vLLM: {result['serve_command']}")
        if warning:  # beside the command too: it is what a user copies
            say(f"warning: {warning}")
    write_json_atomic(ctx.run.evaluate, result, indent=2)
    merge_summary(ctx.run, result | phase_fields(ctx.run, evaluate=time.monotonic() - t0))
    finished(ctx.run)
    return 0


def evaluate_in_fresh_process(recipe: str, overrides: Sequence[str], environ: Mapping[str, str]) -> int:
    """The evaluate role in a process `roles.child` spawned from submitit's task of trainer rank 0,
    with the task's environment from before its trainer set torch.distributed's variables."""
    os.environ.clear()
    os.environ.update(environ)
    return run_evaluate(load_context(recipe, list(overrides)))
