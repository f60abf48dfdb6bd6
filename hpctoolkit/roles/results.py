"""What a run leaves its user: `summary.json` and the `<paths.output_dir>/latest` link, the same on
every backend (the embedded run, a batch script, submitit).

Trainer rank 0 writes `summary.json` when training ends (`roles.trainer`; the fields are assembled
in `rundir.summary`). With `evaluate.enabled` the evaluate role runs after the trainers (the local
launcher, the batch script's last step, or submitit's task of trainer rank 0) and merges its
figures in (`rundir.summary.merge_summary`). The run's last role
then calls `finished`, which points `latest` at the run: the trainer when evaluate is off, else
evaluate. A run whose evaluation failed or never ran keeps its summary but does not become `latest`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpctoolkit.output.figures import figure
from hpctoolkit.recipe.schema import RecipeConfig
from hpctoolkit.rundir.layout import RunDir


def trainers_are_last(cfg: RecipeConfig) -> bool:
    """Whether trainer rank 0 is the run's last role (no evaluate role follows it)."""
    return not cfg.evaluate.enabled


def finished(run: RunDir) -> None:
    """The run's last role is done: `<output_dir>/latest` points at this run."""
    run.link_latest()


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
