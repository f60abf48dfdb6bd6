"""The phases of a run, in order: the one description that the embedded launcher executes, the
batch-script renderer renders and each submitit task follows. Pure: names and order, no processes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Phase:
    name: str
    what: str


PHASES: tuple[Phase, ...] = (
    Phase("start", "attempt start: the run directory, its config.yaml, an earlier attempt's records cleared"),
    Phase("master", "the Mooncake master is up (skipped with an external master)"),
    Phase("engines", "engine leaders and headless followers capture and publish"),
    Phase("trainers", "the trainers read, train and export; the run's outcome is theirs"),
    Phase("drain", "the engines leave by themselves once drained, within one grace"),
    Phase("evaluate", "serve the export and merge the figures (evaluate.enabled, a clean run)"),
    Phase("stop", "the master last, after every engine unmounted its segments"),
    Phase("end", "the end records and summary.json"),
)
PHASE_NAMES: tuple[str, ...] = tuple(p.name for p in PHASES)
