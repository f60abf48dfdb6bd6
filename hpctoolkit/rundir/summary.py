"""`summary.json`: what a run leaves its user, assembled here from the run directory's records.

Trainer rank 0 writes it when training ends (`roles.trainer`, through `write_trainer_summary`):
training's own figures (`train_fields`), and for a live run what the records say moved
(`rundir.totals`), where each role ran, the synthesized data and the phases' wall time
(`live_summary`). The evaluate role merges its figures in afterwards (`merge_summary`). Which role
then points `latest` at the run is the roles' business (`roles.results`).

A summary written again never loses the figures of the one before it. A run is resumed by hand (a
Slurm job given an earlier job's run directory through `HPCTOOLKIT_RUN_ID`), or requeued, into a
directory that may already hold a summary: `train/train_summary.json`, and `summary.json` (which
`ledger.begin_attempt` moves to `summary.earlier.json` while the new attempt runs, so the run does
not look finished). The new summary is written through `carry_forward`:

* an attempt that trained no step (its run had finished: it resumed from the last checkpoint and
  stopped there) leaves the earlier figures standing; its own fill only what they lack, and
  `steps_this_run` / `resumed_from_step` say what this attempt did;
* an attempt that trained keeps its own figures, and the earlier ones it has no value for.

`carry_forward` and `train_fields` are pure: dictionaries in, a dictionary out.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctoolkit.rundir import totals
from hpctoolkit.rundir.atomic import read_json, write_json_atomic
from hpctoolkit.rundir.layout import RunDir

# This attempt's own facts: never taken from an earlier summary.
ATTEMPT_KEYS = ("steps_this_run", "resumed_from_step")
# Training's own figures, as `train.run.train` returns them.
TRAIN_KEYS = ("steps_trained", "steps_this_run", "final_loss", "supervised_tokens", "export_dir", "gpu_busy")
TRAINER_KEYS = ("acceptance_length", "acceptance_depth", "acceptance_length_by_k", "acceptance_convention")


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


def trainer_fields(result: Mapping[str, Any], served_k: int) -> dict[str, Any]:
    """The trainer's acceptance figures from its summary (`train.metrics.trainer_figures`), with the
    one at the k vLLM serves (`evaluate.num_speculative_tokens`) named: `acceptance_length` alone is
    at the draft's own depth, which may exceed the served k (and its ceiling, k + 1)."""
    by_k = result.get("acceptance_length_by_k") or {}
    return {key: result.get(key) for key in TRAINER_KEYS} | {
        "served_k": served_k,
        "acceptance_length_at_served_k": by_k.get(str(served_k)),
    }


def train_fields(result: Mapping[str, Any] | None, served_k: int) -> dict[str, Any]:
    """Training's figures for the summary: its own (`TRAIN_KEYS`) and its acceptance (`trainer_fields`)."""
    result = result or {}
    return {k: result.get(k) for k in TRAIN_KEYS} | trainer_fields(result, served_k)


@dataclass(frozen=True)
class TrainerReport:
    """What trainer rank 0 reports from besides training's result, fixed when its job is built
    (`roles.trainer_job`): metadata only."""

    run: RunDir
    recipe: str
    run_id: str
    served_k: int  # evaluate.num_speculative_tokens
    links_latest: bool  # the trainers are the run's last role (`roles.results.trainers_are_last`)
    world_size: int = 1
    prefixes: tuple[str, ...] = ()  # a live run's engine queues of this attempt
    node_roles: tuple[tuple[str, ...], ...] = ()  # the plan's roles on each node, sorted
    remote_ranks: tuple[int, ...] = ()  # trainer ranks on nodes that run no engine

    @property
    def read_records(self) -> list[Path]:
        """Each rank's read record (`train.source.LiveSource`), by rank."""
        return [self.run.spool_files.read_record(r) for r in range(self.world_size)]


def offline_summary(report: TrainerReport, result: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"recipe": report.recipe, "run_id": report.run_id, **train_fields(result, report.served_k)}


def live_summary(
    report: TrainerReport,
    result: Mapping[str, Any] | None,
    *,
    drain: Mapping[str, Any],
    count_keys: Callable[[], int | None],
    t0: float,
    read_timeout_s: float,
) -> dict[str, Any]:
    """A live run's summary once training ended on every rank. `drain` is what the drain watch
    found, read as it goes on (`at_s`: when every rank had read its share; `keys_left_in_store`);
    `count_keys` counts the keys the master holds where the watch did not; `t0`: when the rank
    began its job. `samples_unread` is there whenever not every published sample was read."""
    fields = train_fields(result, report.served_k)
    records = report.read_records
    published = totals.published(report.run, report.prefixes)
    read, moved = totals.wait_read_totals(
        records,
        report.prefixes,
        published,
        wait=report.world_size > 1,
        drained=lambda: "at_s" in drain,
        timeout_s=read_timeout_s,
    )
    keys_left = drain.get("keys_left_in_store")
    if keys_left is None:
        keys_left = count_keys()
    summary = {
        "recipe": report.recipe,
        "run_id": report.run_id,
        "samples_published": published,
        "samples_read": read,
        "bytes_moved": moved,
        "keys_left_in_store": keys_left,
        **fields,
        "drained_after_s": round(drain["at_s"], 1) if "at_s" in drain else None,
        "train_wall_seconds": round(time.monotonic() - t0, 1),
        **hosts_fields(report),
        **synthesized_fields(report.run),
        **phase_fields(report.run, train=time.monotonic() - t0),
    }
    if published is None or read != published:
        summary["samples_unread"] = None if published is None else published - read
    return summary


def hosts_fields(report: TrainerReport) -> dict[str, Any]:
    """Where each role ran (the address its node recorded) and the bytes trainer ranks read from
    other hosts: all of a rank's bytes when its node runs no engine (the fragments live in the
    engines' store segments)."""
    hosts = {}
    for node, node_roles in enumerate(report.node_roles):
        rec = read_json(report.run.host(node)) or {}
        hosts[f"n{node}"] = {
            "host": rec.get("nodename"),
            "address": rec.get("address"),
            "roles": list(node_roles),
        }
    spool = report.run.spool_files
    across = sum(
        int((read_json(spool.read_record(rank)) or {}).get("bytes", 0)) for rank in report.remote_ranks
    )
    return {"hosts": hosts, "bytes_across_hosts": across}


def write_trainer_summary(report: TrainerReport, summary: Mapping[str, Any]) -> dict[str, Any]:
    """Rank 0's last word: the summary (an earlier attempt's figures kept, `carry_forward`), then the
    services' cue to stop (`ended.json`), and `latest` when no evaluate role follows. Returns what
    was written."""
    run = report.run
    written = carry_forward(summary, read_json(run.summary_earlier))
    write_json_atomic(run.summary, written, indent=2)
    write_json_atomic(run.ended, {"ok": True})
    if report.links_latest:
        run.link_latest()
    return written


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
