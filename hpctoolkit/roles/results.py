"""What a run leaves its user: `summary.json` and the `<paths.output_dir>/latest` link, the same on
every backend (the embedded run, a batch script, submitit).

Trainer rank 0 writes `summary.json` when training ends (`roles.trainer`). With `evaluate.enabled`
the evaluate role runs after the trainers (the local launcher, the batch script's last step, or
submitit's task of trainer rank 0) and merges its figures in (`merge_summary`). The run's last role
then calls `finished`, which points `latest` at the run: the trainer when evaluate is off, else
evaluate. A run whose evaluation failed or never ran keeps its summary but does not become `latest`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpctoolkit.output.figures import figure
from hpctoolkit.recipe.schema import RecipeConfig
from hpctoolkit.rundir.atomic import read_json, write_json_atomic
from hpctoolkit.rundir.layout import RunDir


def merge_summary(run: RunDir, fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` merged into the run's `summary.json` (written atomically); returns the whole summary."""
    summary = read_json(run.summary) or {}
    summary.update(fields)
    write_json_atomic(run.summary, summary, indent=2)
    return summary


def synthesized_fields(run: RunDir) -> dict[str, Any]:
    """`{"data": {"synthesized": ...}}` when the engines wrote `builtin:magpie` rows (their
    `logs/synth-engine<i>.json`: every engine synthesizes the same pool, so engine 0's counts,
    with `engines_agree` false should another engine's differ), else nothing."""
    found = [read_json(p) for p in sorted(run.logs.glob("synth-engine*.json"))]
    reports: list[dict[str, Any]] = [r for r in found if isinstance(r, dict)]
    if not reports:
        return {}
    keys = ("rows", "candidates", "kept", "dropped")
    agree = all({k: r.get(k) for k in keys} == {k: reports[0].get(k) for k in keys} for r in reports)
    return {"data": {"synthesized": {**reports[0], "engines_agree": agree}}}


def phase_fields(run: RunDir, **more: float) -> dict[str, Any]:
    """`{"phases_s": {...}}`: where a run's wall time went, so the next bottleneck shows without a
    profiler. Each engine leader's `logs/phases-engine<i>.json` (`regenerate`, `engine_start`,
    `capture`; the slowest engine's of each), what the summary already holds, and `more` (the
    trainers' `train`, the evaluation's `evaluate`)."""
    out: dict[str, float] = dict((read_json(run.summary) or {}).get("phases_s") or {})
    for path in sorted(run.logs.glob("phases-engine*.json")):
        rec = read_json(path)
        for k, v in (rec if isinstance(rec, dict) else {}).items():
            out[k] = max(float(out.get(k, 0.0)), float(v))
    out.update({k: round(v, 1) for k, v in more.items()})
    return {"phases_s": out} if out else {}


def trainers_are_last(cfg: RecipeConfig) -> bool:
    """Whether trainer rank 0 is the run's last role (no evaluate role follows it)."""
    return not cfg.evaluate.enabled


def finished(run: RunDir) -> None:
    """The run's last role is done: `<output_dir>/latest` points at this run."""
    run.link_latest()


TRAINER_KEYS = ("acceptance_length", "acceptance_depth", "acceptance_length_by_k", "acceptance_convention")


def trainer_fields(result: dict[str, Any], served_k: int) -> dict[str, Any]:
    """The trainer's acceptance figures from its summary (`train.metrics.trainer_figures`), with the
    one at the k vLLM serves (`evaluate.num_speculative_tokens`) named: `acceptance_length` alone is
    at the draft's own depth, which may exceed the served k (and its ceiling, k + 1)."""
    by_k = result.get("acceptance_length_by_k") or {}
    return {key: result.get(key) for key in TRAINER_KEYS} | {
        "served_k": served_k,
        "acceptance_length_at_served_k": by_k.get(str(served_k)),
    }


def trainer_acceptance_line(fields: Mapping[str, Any]) -> str:
    """The trainer's figures for the terminal, each with its k."""
    own, depth = fields.get("acceptance_length"), fields.get("acceptance_depth")
    if own is None:
        return "trainer acceptance length -"
    line = f"trainer acceptance length {figure(own)} at its depth k={depth}"
    at_k, k = fields.get("acceptance_length_at_served_k"), fields.get("served_k")
    if k is not None and k != depth:
        line += f", {figure(at_k)} at the served k={k}" if at_k is not None else f", none at the served k={k}"
    return line + " (own training batches, every start position, incl. bonus)"
