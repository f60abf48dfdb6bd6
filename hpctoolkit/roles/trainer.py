"""The `trainer` role: one FSDP rank.

Ranks read every engine's queue through `LiveSource` (each rank fetches its share from the store
and spools it for later epochs), train, checkpoint and export. Rank 0 writes `drained` once every
rank read its whole share (the engines then release their segments, while training goes on), and
at the end `summary.json` (assembled in `rundir.summary`) and `ended.json` (the services' cue to
stop), and points `latest` at the run when it is the run's last role (`roles.results`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from hpctoolkit.output.console import speaker
from hpctoolkit.output.figures import figure
from hpctoolkit.plan.placement import Process
from hpctoolkit.roles.context import NodeContext
from hpctoolkit.roles.results import trainer_acceptance_line
from hpctoolkit.roles.trainer_job import TrainerJob, trainer_job
from hpctoolkit.rundir import ledger, totals
from hpctoolkit.rundir.summary import live_summary, offline_summary, write_trainer_summary
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
            ledger.end_failed(job.run, err)
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
        ledger.end_preempted(job.run, step)
        say(
            f"SIGUSR2: checkpointed at step {step} (nothing new when no step was trained since the last); "
            f"requeue the job to resume (exit {ledger.PREEMPTED_EXIT})"
        )
    else:
        ledger.wait_preempted(job.run, PREEMPT_RECORD_WAIT_S)
    return ledger.PREEMPTED_EXIT


class _DrainWatch:
    """Rank 0: release the engines (`drained`) as soon as every rank read its share."""

    def __init__(self, job: TrainerJob):
        self.job, self.metrics = job, job.metrics
        self.records = job.report.read_records
        self.result: dict[str, Any] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="hpctoolkit-drain-watch", daemon=True)

    def _watch(self) -> None:
        from hpctoolkit.capture.queue import write_drained

        while not self.stop.wait(0.5):
            if totals.read_totals(self.records, self.job.prefixes)[2]:
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
        return offline_summary(job.report, result)
    watch.thread.join(timeout=30)
    summary = live_summary(
        job.report,
        result,
        drain=watch.result,
        count_keys=lambda: _count_keys(watch.metrics),
        t0=job.t0,
        read_timeout_s=READ_RECORDS_TIMEOUT_S,
    )
    if "samples_unread" in summary:
        # Not an error (training.steps may end before one pass), but never silent.
        read, published = summary["samples_read"], summary["samples_published"]
        say(f"WARNING: trained on {read} of {published} published samples; the rest were never read")
    return summary


def _finish(job: TrainerJob, summary: dict[str, Any]) -> None:
    """Rank 0's last word (`rundir.summary.write_trainer_summary`: the summary, an earlier attempt's
    figures kept; the services' cue to stop; `latest` when no evaluate role follows), then its line."""
    summary = write_trainer_summary(job.report, summary)
    say(
        f"trained {summary.get('steps_trained')} steps on {summary.get('samples_read')} samples; "
        f"final loss {figure(summary.get('final_loss'))}; keys left in store {summary.get('keys_left_in_store')}; "
        + trainer_acceptance_line(summary)
    )
