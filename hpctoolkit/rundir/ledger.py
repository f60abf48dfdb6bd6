"""The sample ledger: which prompts went into a completed, checkpointed training step.

A live run's samples come from the store, which hands each out once and is gone with its master.
To resume such a run after a preemption, the engines must capture again exactly the prompts no
completed checkpoint trained on, and the trainers must continue from that checkpoint. The ledger
is what ties the two together; it is part of the checkpoint itself, so it cannot disagree with it:

    train/checkpoints/step-N.partial/ledger-rank<r>.json   rank r's part, written with its shards
    train/checkpoints/step-N/meta.json                     written last: the checkpoint (and so
                                                           its ledger) counts from then on

A part is `{"rank", "step", "prompts": [global prompt index, ...], "keys": [content key, ...]}`:
every prompt rank r trained on in a step <= N (its first pass over the store), and beside each the
key of its content (`data.prompts.row_key`; None where a manifest carried none; a part from before
the keys has no "keys" and reads as all None). The prompt index is the position in the run's
prompt list (`data.prompts` after loading); an engine leader tags each manifest with it and its key
(`manifest.extra["prompt"]`, `["prompt_key"]`), and engine i captures prompts `i::num_engines`.
A resumed engine refuses a prompt whose content key differs from the ledger's (`changed`): an
index alone would skip a new prompt that took a trained one's place, or repeat a moved one. The
ledger of a run is the union of the parts of its newest complete checkpoint; a part missing there
fails closed (`DataIntegrityError`), never "nothing trained".

The attempt record `attempt.json` (`{"job_id", "restart", "resume_step"}`) marks which attempt of a Slurm job
the run directory's records belong to. `begin_attempt` removes what an earlier attempt left that
would mislead this one (its master's address, its end records, its engines' close records; its
summary is set aside as `summary.earlier.json`, `rundir.summary`) and then writes it; it runs once per attempt before any role reads them (`start_attempt`: the batch
script's `check` step; under submitit, task 0 while the other tasks wait in `wait_attempt`; the
embedded launcher, without a job, in a fresh directory).

The trainers' end record `ended.json` tells the services the attempt is over: `{"ok": true}` with
the summary (`rundir.summary`), `{"ok": false, "error"}` when they failed (`end_failed`), and
`{"ok": false, "preempted": true, "step"}` once they checkpointed on SIGUSR2 (`end_preempted`,
which `preempted_attempt` reads back).

Pure file I/O: no torch, no store.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpctoolkit.errors import DataIntegrityError, StoreError
from hpctoolkit.rundir import alive, inputs_record
from hpctoolkit.rundir.atomic import read_json, write_json_atomic, write_text_atomic
from hpctoolkit.rundir.layout import RunDir

# The manifest `extra` keys an engine leader puts the sample's prompt index and content key under.
PROMPT_KEY = "prompt"
CONTENT_KEY = "prompt_key"
META = "meta.json"
STEP_DIR = re.compile(r"step-\d+")
# Trainers exit with this status when they checkpointed on SIGUSR2 and want the job requeued.
PREEMPTED_EXIT = 75
# Under submitit, the other tasks wait this long for task 0's attempt record.
ATTEMPT_TIMEOUT_S = 120.0


def part_name(rank: int) -> str:
    return f"ledger-rank{rank}.json"


def write_part(
    checkpoint_dir: str | os.PathLike[str],
    rank: int,
    step: int,
    prompts: Mapping[int, str | None] | Iterable[int],
) -> Path:
    """Rank `rank`'s part of the ledger of the checkpoint being written in `checkpoint_dir`:
    `prompts` maps each prompt index it trained on to its content key (or lists indices only)."""
    pairs = prompts.items() if isinstance(prompts, Mapping) else ((p, None) for p in prompts)
    keyed = {int(p): k for p, k in pairs}
    order = sorted(keyed)
    record = {"rank": rank, "step": step, "prompts": order, "keys": [keyed.get(p) for p in order]}
    return write_json_atomic(Path(checkpoint_dir) / part_name(rank), record)


def read_part(checkpoint_dir: str | os.PathLike[str], rank: int) -> dict[int, str | None]:
    """Rank `rank`'s trained prompts in a complete checkpoint, each with its content key (None when
    the part has none); raises if its part is missing."""
    path = Path(checkpoint_dir) / part_name(rank)
    record = read_json(path)
    if not isinstance(record, dict) or not isinstance(record.get("prompts"), list):
        raise DataIntegrityError(
            f"{path} is missing or unreadable: checkpoint {Path(checkpoint_dir).name} does not say "
            "which samples it trained on, so a resume could skip or repeat some"
        )
    prompts = [int(p) for p in record["prompts"]]
    keys = record.get("keys")
    if not isinstance(keys, list) or len(keys) != len(prompts):
        keys = [None] * len(prompts)  # a part from before the content keys
    return {p: (str(k) if k is not None else None) for p, k in zip(prompts, keys, strict=True)}


def complete_checkpoints(checkpoints: str | os.PathLike[str]) -> list[Path]:
    """`step-<digits>` directories with their `meta.json`, oldest first. Anything else there (a
    `.partial` or `.unreadable` one, a directory a user put there) is not a checkpoint."""
    root = Path(checkpoints)
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and p.is_dir() and (p / META).is_file()]
    return sorted(done, key=lambda p: int(p.name.split("-")[1]))


@dataclass(frozen=True)
class Ledger:
    """The newest complete checkpoint's step and every prompt trained on up to it."""

    step: int
    checkpoint: Path
    prompts: frozenset[int]
    # Each trained prompt's content key, where its part recorded one.
    keys: Mapping[int, str] = field(default_factory=dict)

    def of_engine(self, engine: int, num_engines: int) -> frozenset[int]:
        return frozenset(p for p in self.prompts if p % num_engines == engine)

    def changed(self, keys: Mapping[int, str]) -> list[tuple[int, str, str]]:
        """`(index, key at the checkpoint, key now)` of each trained prompt whose content is no
        longer the one it trained on (`keys`: the content key of each prompt index now)."""
        return [
            (p, self.keys[p], keys[p])
            for p in sorted(self.prompts)
            if p in self.keys and p in keys and self.keys[p] != keys[p]
        ]


def read_ledger(checkpoints: str | os.PathLike[str], step: int | None = None) -> Ledger | None:
    """The ledger of the newest complete checkpoint (of step `step` when given), or None when no
    checkpoint completed yet."""
    done = complete_checkpoints(checkpoints)
    if step is not None:
        done = [p for p in done if int(p.name.split("-")[1]) == step]
        if not done:
            raise DataIntegrityError(
                f"checkpoint step {step} of {checkpoints}, which this attempt resumes from, is gone"
            )
    if not done:
        return None
    latest = done[-1]
    meta = json.loads((latest / META).read_text())
    prompts: dict[int, str | None] = {}
    for rank in range(int(meta["world_size"])):
        prompts.update(read_part(latest, rank))
    keys = {p: k for p, k in prompts.items() if k is not None}
    return Ledger(int(meta["step"]), latest, frozenset(prompts), keys)


def preempted_attempt(run: RunDir) -> str | None:
    """Why this attempt of `run` counts as preempted (its trainers checkpointed on SIGUSR2, the
    checkpoint complete), or None. The batch script asks when the trainers' step ended with another
    status: under `srun --kill-on-bad-exit` the first rank to exit with PREEMPTED_EXIT ends the
    others' tasks, so the step's status is a race; the records are not."""
    ended = read_json(run.ended)
    if not (isinstance(ended, dict) and ended.get("preempted")):
        return None
    done = read_ledger(run.checkpoints)
    if done is None or done.step != ended.get("step"):
        return None
    return f"checkpoint step-{done.step:08d} of run {run.run_id} is complete"


def end_failed(run: RunDir, err: BaseException) -> None:
    """The trainers failed with `err`: the services' cue to stop, and what `hpctoolkit.status` shows."""
    write_json_atomic(run.ended, {"ok": False, "error": f"{type(err).__name__}: {err}"})


def end_preempted(run: RunDir, step: int | None) -> None:
    """The trainers checkpointed at `step` on SIGUSR2 (None: no step this attempt): requeue the job."""
    write_json_atomic(run.ended, {"ok": False, "preempted": True, "step": step})


def wait_preempted(run: RunDir, timeout_s: float) -> bool:
    """Whether `end_preempted`'s record appeared within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (read_json(run.ended) or {}).get("preempted"):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
    return True


def remaining(share: Iterable[int], ledger: Ledger | None) -> list[int]:
    """The prompt indices of `share` that no completed checkpoint trained on, in order."""
    done = ledger.prompts if ledger is not None else frozenset()
    return [p for p in share if p not in done]


def store_run_id(run_id: str, job_id: str | None, restart: int) -> str:
    """The run id an attempt's sample keys carry. The first attempt of a job in its own run
    directory keeps the run id; a requeued attempt (or a job resuming another's run) gets its own,
    so its keys never meet fragments an earlier attempt left in a store that outlived it."""
    if job_id is None or (restart <= 0 and run_id.endswith(f"-j{job_id}")):
        return run_id
    return f"{run_id}-j{job_id}r{restart}"


def attempt_ledger(run: RunDir) -> Ledger | None:
    """The ledger this attempt resumes from: the checkpoint `begin_attempt` found (so an engine that
    starts late does not see a checkpoint this attempt's trainers wrote since), else the newest."""
    record = read_json(run.attempt)
    step = record.get("resume_step") if isinstance(record, dict) else None
    return read_ledger(run.checkpoints, step)


def attempt_run_id(run_id: str, job_id: str | None, env: Mapping[str, str] | None = None) -> str:
    """`store_run_id` of this process's attempt (`SLURM_RESTART_COUNT` from its environment)."""
    return store_run_id(run_id, job_id, restart_count(env))


def restart_count(env: Mapping[str, str] | None = None) -> int:
    """How often Slurm requeued this job (`SLURM_RESTART_COUNT`; 0 on the first attempt)."""
    value = (os.environ if env is None else env).get("SLURM_RESTART_COUNT", "") or "0"
    try:
        return int(value)
    except ValueError:
        return 0


def start_attempt(
    run: RunDir,
    config_yaml: str,
    pinned: inputs_record.Pin,
    job_id: str | None,
    *,
    fresh: bool = False,
    restart: int | None = None,
) -> bool:
    """The lifecycle's `start` phase, the one way every backend begins an attempt: make the run
    directory (`fresh`: a new one, refused if the id is taken, as a local run's always is), pin its
    inputs at the first attempt or refuse any that changed since (`rundir.inputs_record`: `ConfigError`,
    before anything of the run is touched), write its `config.yaml` atomically and, in a Slurm
    job, clear an earlier attempt's records (`begin_attempt`). True when there were such records."""
    if fresh:
        run.create()
    else:
        run.root.mkdir(parents=True, exist_ok=True)
    inputs_record.pin(run, pinned)
    write_text_atomic(run.config, config_yaml)
    if job_id is None:
        return False
    return begin_attempt(run, job_id, restart_count() if restart is None else restart)


def begin_attempt(run: RunDir, job_id: str, restart: int) -> bool:
    """Start attempt `restart` of job `job_id` in `run`; True when it found an earlier attempt's
    records. Idempotent within one attempt."""
    record = {"job_id": str(job_id), "restart": int(restart)}
    old = read_json(run.attempt)
    if isinstance(old, dict) and {k: old.get(k) for k in record} == record:
        return False
    done = complete_checkpoints(run.checkpoints)
    record["resume_step"] = int(done[-1].name.split("-")[1]) if done else None
    found = _set_summary_aside(run)
    stale = [run.master_record, run.ended, run.drained]
    if run.progress_dir.is_dir():
        stale += sorted(run.progress_dir.glob("*.json"))  # an earlier attempt's progress
    if run.ports.is_dir():
        stale += sorted(run.ports.glob("*.json"))  # an earlier attempt's ports, long closed
    # An earlier attempt's role records and probes: its roles, ended with the job, must not
    # look dead to this attempt's watch (`rundir.alive`, `roles.watch`).
    died = alive.died_path(run.root)
    stale += [died, died.with_suffix(".said"), *sorted(alive.alive_dir(run.root).glob("*.json"))]
    stale += sorted((run.root / "hosts").glob("*.probe"))
    if run.manifests.is_dir():
        stale += sorted(run.manifests.glob("engine*.closed"))
        stale += sorted(run.manifests.glob("engine*.done")) + sorted(run.manifests.glob("engine*.failed"))
    for path in stale:
        if path.exists():
            found = True
            path.unlink(missing_ok=True)
    # The leaders remove the fragments an earlier attempt's queue lists (a store that outlived
    # it still holds them), then the list.
    for engine in range(_queue_count(run)):
        queue, stale_list = run.queue(engine), run.stale_queue(engine)
        if queue.exists():
            found = True
            # Whole or not at all: a torn line would stop the leader reading the list. A crash
            # before the unlink lists the queue twice, which only removes its fragments twice.
            listed = stale_list.read_text() if stale_list.exists() else ""
            write_text_atomic(stale_list, listed + queue.read_text())
            queue.unlink()
    write_json_atomic(run.attempt, record)
    return found


def _set_summary_aside(run: RunDir) -> bool:
    """Move an earlier attempt's `summary.json` to `summary.earlier.json` (the run is not finished
    while this attempt runs; its figures are the user's and are carried forward, `rundir.summary`).
    True when there was one."""
    if not run.summary.exists():
        return False
    os.replace(run.summary, run.summary_earlier)
    return True


def _queue_count(run: RunDir) -> int:
    names = [p.name for p in run.manifests.glob("engine*.jsonl")] if run.manifests.is_dir() else []
    ids = [
        int(n[len("engine") : -len(".jsonl")]) for n in names if n[len("engine") : -len(".jsonl")].isdigit()
    ]
    return max(ids) + 1 if ids else 0


def wait_attempt(run: RunDir, job_id: str, restart: int, timeout_s: float = ATTEMPT_TIMEOUT_S) -> None:
    """Wait until `begin_attempt` ran for this attempt (bounded; names what it waited for)."""
    want = {"job_id": str(job_id), "restart": int(restart)}

    def started() -> bool:
        rec = read_json(run.attempt)
        return isinstance(rec, dict) and {k: rec.get(k) for k in want} == want

    deadline = time.monotonic() + timeout_s
    while not started():
        if time.monotonic() > deadline:
            raise StoreError(
                f"{run.attempt} does not name attempt {restart} of job {job_id} after "
                f"{timeout_s:.0f}s; task 0 of the job starts each attempt"
            )
        time.sleep(0.2)
