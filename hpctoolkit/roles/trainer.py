"""The `trainer` role: one FSDP rank.

Ranks read every engine's queue through `LiveSource` (each rank fetches its share from the store
and spools it for later epochs), train, checkpoint and export. Rank 0 writes `drained` once every
rank read its whole share (the engines then release their segments, while training goes on), and
at the end `summary.json` and `ended.json` (the services' cue to stop), and points `latest` at the
run when it is the run's last role (`roles.results`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from hpctoolkit.output.console import speaker
from hpctoolkit.output.figures import figure
from hpctoolkit.plan.placement import Process
from hpctoolkit.roles.context import NodeContext
from hpctoolkit.roles.results import (
    finished,
    phase_fields,
    synthesized_fields,
    trainer_acceptance_line,
    trainer_fields,
    trainers_are_last,
)
from hpctoolkit.roles.trainer_job import TrainerJob, tell_failed, trainer_job
from hpctoolkit.rundir import ledger, totals
from hpctoolkit.rundir.atomic import read_json, write_json_atomic
from hpctoolkit.rundir.summary import carry_forward
from hpctoolkit.train import preempt

# Rank 0 waits this long for the other ranks' read records after training.
READ_RECORDS_TIMEOUT_S = 300.0
# After a checkpoint on SIGUSR2, ranks > 0 wait at most this long for rank 0's `ended` record.
PREEMPT_RECORD_WAIT_S = 30.0


say = speaker("trainer")


def engine_share(num_samples: int, num_engines: int, engine: int) -> int:
    """How many of the run's prompts engine `engine` captures (prompts `engine::num_engines`)."""
    return len(range(engine, num_samples, num_engines))


def run_trainer(ctx: NodeContext, proc: Process) -> int:
    """0 once trained; `ledger.PREEMPTED_EXIT` after a checkpoint on SIGUSR2 (requeue the job)."""
    # First: SIGUSR2's default action ends the process, and the notice may come at any time.
    preempt.install()
    from hpctoolkit.train.run import train_on

    job = trainer_job(ctx, proc)
    # A live run's rank 0 releases the engines once every rank read its share.
    watch = _DrainWatch(job) if job.live else None
    if watch is not None and job.rank0:
        watch.thread.start()
    try:
        result = train_on(
            job.cfg, job.target_dir, job.samples, job.run.train, progress_file=job.run.progress("trainer")
        )
    except BaseException as err:
        if job.rank0 and job.live:
            tell_failed(job.run, err)
        raise
    finally:
        if watch is not None:
            watch.close()
    if preempt.requested():
        return _preempted(job, result)
    if job.rank0:
        _finish(job, _summary(job, watch, result))
    return 0


def _preempted(job: TrainerJob, result: dict[str, Any] | None) -> int:
    """Every rank wrote its part of the checkpoint; rank 0 tells the services the run stopped.
    The other ranks leave only once that record exists: the first rank to exit ends the others'
    tasks (`srun --kill-on-bad-exit`), and the batch script reads the record to requeue."""
    if job.rank0:
        step = (result or {}).get("steps_trained")
        write_json_atomic(job.run.ended, {"ok": False, "preempted": True, "step": step})
        say(
            f"SIGUSR2: checkpointed at step {step} (nothing new when no step was trained since the last); "
            f"requeue the job to resume (exit {ledger.PREEMPTED_EXIT})"
        )
    else:
        deadline = time.monotonic() + PREEMPT_RECORD_WAIT_S
        while not (read_json(job.run.ended) or {}).get("preempted") and time.monotonic() < deadline:
            time.sleep(0.2)
    return ledger.PREEMPTED_EXIT


def _train_fields(job: TrainerJob, result: dict[str, Any] | None) -> dict[str, Any]:
    result = result or {}
    keys = ("steps_trained", "steps_this_run", "final_loss", "supervised_tokens", "export_dir", "gpu_busy")
    return {k: result.get(k) for k in keys} | trainer_fields(result, job.cfg.evaluate.num_speculative_tokens)


def _hosts(job: TrainerJob, source: Any) -> dict[str, Any]:
    """Where each role ran (the address its node recorded) and the bytes trainer ranks read from
    other hosts: all of a rank's bytes when its node runs no engine (the fragments live in the
    engines' store segments)."""
    plan = job.plan
    roles = {node: sorted({p.role for p in plan.on_node(node)}) for node in range(plan.num_nodes)}
    engine_nodes = {n.node for e in plan.engines for n in e.nodes}
    remote = [r.rank for r in plan.trainer.ranks if r.node not in engine_nodes]
    hosts = {}
    for node, node_roles in roles.items():
        rec = read_json(job.run.host(node)) or {}
        hosts[f"n{node}"] = {"host": rec.get("nodename"), "address": rec.get("address"), "roles": node_roles}
    across = sum(int((read_json(source.read_record(rank)) or {}).get("bytes", 0)) for rank in remote)
    return {"hosts": hosts, "bytes_across_hosts": across}


def _read_records(job: TrainerJob) -> list[Any]:
    """Each rank's read record (`LiveSource.read_record`), by rank."""
    return [job.samples.read_record(r) for r in range(job.plan.trainer.world_size)]


class _DrainWatch:
    """Rank 0: release the engines (`drained`) as soon as every rank read its share."""

    def __init__(self, job: TrainerJob):
        self.job, self.source, self.metrics = job, job.samples, job.metrics
        self.records = _read_records(job)
        self.result: dict[str, Any] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="hpctoolkit-drain-watch", daemon=True)

    def _watch(self) -> None:
        from hpctoolkit.capture.queue import write_drained

        while not self.stop.wait(0.5):
            if totals.read_totals(self.records, self.source.engine_prefixes)[2]:
                try:
                    self.result["keys_left_in_store"] = _count_keys(self.metrics)
                finally:  # the engines go either way; a failed count is counted again later
                    write_drained(self.job.run.root, self.job.run_id)
                self.result["at_s"] = time.monotonic() - self.job.t0
                return

    def close(self) -> None:
        from hpctoolkit.capture.queue import write_drained

        self.stop.set()
        if "at_s" not in self.result:
            # Training ended first (or failed): release the engines anyway; the summary says so.
            write_drained(self.job.run.root, self.job.run_id)


def _count_keys(metrics: str | None) -> int | None:
    """Keys the master holds; None for an external master whose metrics address the recipe omits."""
    from hpctoolkit.store.probe import count_keys_via_master

    return None if metrics is None else count_keys_via_master(metrics)


def _summary(job: TrainerJob, watch: _DrainWatch | None, result: Any) -> dict[str, Any]:
    if watch is None:
        return {"recipe": job.cfg.name, "run_id": job.run_id, **_train_fields(job, result)}
    watch.thread.join(timeout=30)
    return _live_summary(job, job.samples, watch, result)


def _live_summary(job: TrainerJob, source: Any, watch: _DrainWatch, result: Any) -> dict[str, Any]:
    world = job.plan.trainer.world_size
    fields = _train_fields(job, result)
    records = _read_records(job)
    deadline = time.monotonic() + READ_RECORDS_TIMEOUT_S
    published = totals.published(job.run, job.prefixes)
    read, moved, complete = totals.read_totals(records, source.engine_prefixes)
    # A rank's record is complete once its stream ended; one whose steps took exactly its share
    # never asks for more, so every published sample read also ends the wait (it held a job that
    # read all it published, K3's own counts, for the whole timeout).
    while (
        not complete
        and "at_s" not in watch.result
        and world > 1
        and (published is None or read < published)
        and time.monotonic() < deadline
    ):
        time.sleep(0.5)
        read, moved, complete = totals.read_totals(records, source.engine_prefixes)
    keys_left = watch.result.get("keys_left_in_store")
    if keys_left is None:
        keys_left = _count_keys(watch.metrics)
    summary = {
        "recipe": job.cfg.name,
        "run_id": job.run_id,
        "samples_published": published,
        "samples_read": read,
        "bytes_moved": moved,
        "keys_left_in_store": keys_left,
        **fields,
        "drained_after_s": round(watch.result["at_s"], 1) if "at_s" in watch.result else None,
        "train_wall_seconds": round(time.monotonic() - job.t0, 1),
        **_hosts(job, source),
        **synthesized_fields(job.run),
        **phase_fields(job.run, train=time.monotonic() - job.t0),
    }
    if published is None or read != published:
        # Not an error (training.steps may end before one pass), but never silent.
        summary["samples_unread"] = None if published is None else published - read
        say(f"WARNING: trained on {read} of {published} published samples; the rest were never read")
    return summary


def _finish(job: TrainerJob, summary: dict[str, Any]) -> None:
    """Rank 0's last word: the summary, then the services' cue to stop; `latest` too when no
    evaluate role follows (`roles.results`). An earlier attempt's figures are kept (`rundir.summary`)."""
    summary = carry_forward(summary, read_json(job.run.summary_earlier))
    write_json_atomic(job.run.summary, summary, indent=2)
    write_json_atomic(job.run.ended, {"ok": True})
    if trainers_are_last(job.cfg):
        finished(job.run)
    say(
        f"trained {summary.get('steps_trained')} steps on {summary.get('samples_read')} samples; "
        f"final loss {figure(summary.get('final_loss'))}; keys left in store {summary.get('keys_left_in_store')}; "
        + trainer_acceptance_line(summary)
    )
