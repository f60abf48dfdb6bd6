"""A summary written again never loses the figures of the one before it.

A run is resumed by hand (a Slurm job given an earlier job's run directory through
`HPCTOOLKIT_RUN_ID`), or requeued, into a directory that may already hold a summary:
`train/train_summary.json`, and `summary.json` (which `ledger.begin_attempt` moves to
`summary.earlier.json` while the new attempt runs, so the run does not look finished). The new
summary is written through `carry_forward`:

* an attempt that trained no step (its run had finished: it resumed from the last checkpoint and
  stopped there) leaves the earlier figures standing; its own fill only what they lack, and
  `steps_this_run` / `resumed_from_step` say what this attempt did;
* an attempt that trained keeps its own figures, and the earlier ones it has no value for.

Pure: dictionaries in, a dictionary out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# This attempt's own facts: never taken from an earlier summary.
ATTEMPT_KEYS = ("steps_this_run", "resumed_from_step")


def carry_forward(new: Mapping[str, Any], earlier: Any) -> dict[str, Any]:
    """`new` with the figures of `earlier` (a summary read back, None when there was none) kept."""
    out = dict(new)
    if not isinstance(earlier, Mapping):
        return out
    trained_none = new.get("steps_this_run") == 0
    for key, value in earlier.items():
        if key in ATTEMPT_KEYS and key in new:
            continue
        if (trained_none and value is not None) or out.get(key) is None:
            out[key] = value
    return out
