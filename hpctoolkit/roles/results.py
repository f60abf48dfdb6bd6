"""What a run leaves its user: `summary.json` and the `<paths.output_dir>/latest` link, the same on
every backend (the embedded run, a batch script, submitit).

Trainer rank 0 writes `summary.json` when training ends (`roles.trainer`). With `evaluate.enabled`
the evaluate role runs after the trainers (the local launcher, the batch script's last step, or
submitit's task of trainer rank 0) and merges its figures in (`merge_summary`). The run's last role
then calls `finished`, which points `latest` at the run: the trainer when evaluate is off, else
evaluate. A run whose evaluation failed or never ran keeps its summary but does not become `latest`.
"""

from __future__ import annotations

from typing import Any

from hpctoolkit.config.schema import RecipeConfig
from hpctoolkit.rundir.atomic import read_json, write_json_atomic
from hpctoolkit.rundir.layout import RunDir


def merge_summary(run: RunDir, fields: dict[str, Any]) -> dict[str, Any]:
    """`fields` merged into the run's `summary.json` (written atomically); returns the whole summary."""
    summary = read_json(run.summary) or {}
    summary.update(fields)
    write_json_atomic(run.summary, summary, indent=2)
    return summary


def trainers_are_last(cfg: RecipeConfig) -> bool:
    """Whether trainer rank 0 is the run's last role (no evaluate role follows it)."""
    return not cfg.evaluate.enabled


def finished(run: RunDir) -> None:
    """The run's last role is done: `<output_dir>/latest` points at this run."""
    run.link_latest()
