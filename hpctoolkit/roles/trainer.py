"""The `trainer` role: one FSDP rank.

Ranks read every engine's queue through `LiveSource` (each rank fetches its share from the store
and spools it for later epochs), train, checkpoint and export. Rank 0 writes `drained` once every
rank read its whole share (the engines then release their segments, while training goes on), and
at the end `summary.json` and `ended.json` (the services' cue to stop), and points `latest` at the
run when it is the run's last role (`roles.results`).
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

from hpctoolkit import envs
from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.output.console import speaker
from hpctoolkit.output.figures import figure
from hpctoolkit.plan.placement import Process
from hpctoolkit.roles.context import (
    NodeContext,
    client_store_config,
    read_master_record,
    store_address,
    trainer_env,
    trainer_rendezvous,
)
from hpctoolkit.roles.results import (
    finished,
    phase_fields,
    synthesized_fields,
    trainer_acceptance_line,
    trainer_fields,
    trainers_are_last,
)
from hpctoolkit.roles.waits import MASTER_REACH_TIMEOUT_S, wait_reachable
from hpctoolkit.rundir import ledger
from hpctoolkit.rundir.atomic import read_json, write_json_atomic
from hpctoolkit.rundir.summary import carry_forward
from hpctoolkit.train import preempt

# No new manifest from any engine for this long (engine start included) fails the read.
QUEUE_STALL_TIMEOUT_S = 1800.0
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
    from hpctoolkit.train.run import train

    cfg = ctx.cfg
    # One process per rank; train() joins env:// when RANK/WORLD_SIZE are set. Rank 0's store
    # serves on the socket it already listens on: the data-plane address, never all interfaces.
    rendezvous, listening = trainer_rendezvous(ctx, proc)
    os.environ.update(trainer_env(ctx, proc, rendezvous))
    if listening is not None:
        # Handed over: the store owns the descriptor from here (train.fsdp).
        os.environ[envs.HPCTOOLKIT_RENDEZVOUS_FD.name] = str(listening.detach())
    if cfg.training.data_source == "offline":
        if not cfg.data.offline_dir:
            raise ConfigError("training.data_source=offline needs data.offline_dir (the shard folder)")
        result = train(cfg, cfg.data.offline_dir, ctx.run.train, progress_file=ctx.run.progress("trainer"))
        if preempt.requested():
            return _preempted(ctx, proc, result)
        if proc.node_rank == 0:
            _finish(ctx, {"recipe": cfg.name, "run_id": ctx.run_id, **_train_fields(ctx, result)})
        return 0
    return _train_live(ctx, proc)


def _preempted(ctx: NodeContext, proc: Process, result: dict[str, Any] | None) -> int:
    """Every rank wrote its part of the checkpoint; rank 0 tells the services the run stopped.
    The other ranks leave only once that record exists: the first rank to exit ends the others'
    tasks (`srun --kill-on-bad-exit`), and the batch script reads the record to requeue."""
    if proc.node_rank == 0:
        step = (result or {}).get("steps_trained")
        write_json_atomic(ctx.run.ended, {"ok": False, "preempted": True, "step": step})
        say(
            f"SIGUSR2: checkpointed at step {step} (nothing new when no step was trained since the last); "
            f"requeue the job to resume (exit {ledger.PREEMPTED_EXIT})"
        )
    else:
        deadline = time.monotonic() + PREEMPT_RECORD_WAIT_S
        while not (read_json(ctx.run.ended) or {}).get("preempted") and time.monotonic() < deadline:
            time.sleep(0.2)
    return ledger.PREEMPTED_EXIT


def _train_fields(ctx: NodeContext, result: dict[str, Any] | None) -> dict[str, Any]:
    result = result or {}
    keys = ("steps_trained", "steps_this_run", "final_loss", "supervised_tokens", "export_dir", "gpu_busy")
    return {k: result.get(k) for k in keys} | trainer_fields(result, ctx.cfg.evaluate.num_speculative_tokens)


def _hosts(ctx: NodeContext, source: Any) -> dict[str, Any]:
    """Where each role ran (the address its node recorded) and the bytes trainer ranks read from
    other hosts: all of a rank's bytes when its node runs no engine (the fragments live in the
    engines' store segments)."""
    hosts = {}
    for node in range(ctx.plan.num_nodes):
        rec = read_json(ctx.run.host(node)) or {}
        roles = sorted({p.role for p in ctx.plan.on_node(node)})
        hosts[f"n{node}"] = {"host": rec.get("nodename"), "address": rec.get("address"), "roles": roles}
    engine_nodes = {n.node for e in ctx.plan.engines for n in e.nodes}
    across = 0
    for r in ctx.plan.trainer.ranks:
        if r.node not in engine_nodes:
            across += int((read_json(source.read_record(r.rank)) or {}).get("bytes", 0))
    return {"hosts": hosts, "bytes_across_hosts": across}


def _read_totals(source: Any, world_size: int) -> tuple[int, int, bool]:
    """(samples, bytes, every rank complete) from the ranks' read records of this attempt."""
    n = nbytes = 0
    complete = True
    for r in range(world_size):
        rec = read_json(source.read_record(r)) or {}
        if rec.get("prefixes", list(source.engine_prefixes)) != list(source.engine_prefixes):
            rec = {}  # an earlier attempt's
        n += int(rec.get("samples", 0))
        nbytes += int(rec.get("bytes", 0))
        complete = complete and bool(rec.get("complete"))
    return n, nbytes, complete


def _published(ctx: NodeContext, prefixes: Sequence[str]) -> int | None:
    total = 0
    for i, prefix in enumerate(prefixes):
        rec = read_json(ctx.run.queue_done(i))
        if not isinstance(rec, dict) or rec.get("run_prefix") != prefix:
            return None
        total += int(rec["published"])
    return total


def _live_source(ctx: NodeContext, prefixes: tuple[str, ...], done: ledger.Ledger | None) -> Any:
    from hpctoolkit.plan.sizing import check_counts
    from hpctoolkit.store.mooncake import MooncakeStore
    from hpctoolkit.train.source import LiveSource, ManifestQueues

    cfg = ctx.cfg
    n = cfg.engine.num_engines
    # After a preemption the engines capture only what the ledger's checkpoint did not train on.
    expected = tuple(len(ledger.remaining(range(i, cfg.data.num_samples, n), done)) for i in range(n))
    return LiveSource(
        "",
        expected=sum(expected),
        store_factory=functools.partial(
            MooncakeStore, store_address(ctx), client_store_config(ctx), role="reader"
        ),
        retry_max_wait_s=cfg.store.get_retry_max_wait_seconds,
        follow=ManifestQueues(str(ctx.run.root), prefixes, expected, QUEUE_STALL_TIMEOUT_S),
        spool_dir=str(ctx.run.spool),
        # One pass spools nothing; replays are bounded (plan.sizing checked both at load).
        epochs=check_counts(cfg).epochs,
        spool_max_bytes=cfg.training.spool_max_size,
        engine_prefixes=prefixes,
        resumed=done is not None,
        device="cuda" if cfg.training.device == "cuda" else None,
        # Two batches fetched and checked ahead of the step that takes them: the host reads the
        # next batch whole while the GPU trains on this one (`benchmarks/trainer_input.py`).
        read_ahead=max(8, 2 * cfg.training.batch_size),
    )


class _DrainWatch:
    """Rank 0: release the engines (`drained`) as soon as every rank read its share."""

    def __init__(self, ctx: NodeContext, source: Any, metrics: str | None, t0: float):
        self.ctx, self.source, self.metrics, self.t0 = ctx, source, metrics, t0
        self.result: dict[str, Any] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="hpctoolkit-drain-watch", daemon=True)

    def _watch(self) -> None:
        from hpctoolkit.capture.queue import write_drained

        while not self.stop.wait(0.5):
            if _read_totals(self.source, self.ctx.plan.trainer.world_size)[2]:
                try:
                    self.result["keys_left_in_store"] = _count_keys(self.metrics)
                finally:  # the engines go either way; a failed count is counted again later
                    write_drained(self.ctx.run.root, self.ctx.run_id)
                self.result["at_s"] = time.monotonic() - self.t0
                return

    def close(self) -> None:
        from hpctoolkit.capture.queue import write_drained

        self.stop.set()
        if "at_s" not in self.result:
            # Training ended first (or failed): release the engines anyway; the summary says so.
            write_drained(self.ctx.run.root, self.ctx.run_id)


def _metrics_address(ctx: NodeContext) -> str | None:
    if ctx.plan.master is None:
        if ctx.cfg.store.master_metrics_address is None:
            say(
                "WARNING: store.master_metrics_address is unset: summary.json cannot count the keys "
                f"left in the external master at {ctx.cfg.store.master_address} (keys_left_in_store: null)"
            )
        return ctx.cfg.store.master_metrics_address
    return read_master_record(ctx)["metrics_address"]


def _count_keys(metrics: str | None) -> int | None:
    """Keys the master holds; None for an external master whose metrics address the recipe omits."""
    from hpctoolkit.store.probe import count_keys_via_master

    return None if metrics is None else count_keys_via_master(metrics)


def _train_live(ctx: NodeContext, proc: Process) -> int:
    from hpctoolkit.engine.kwargs import run_prefix
    from hpctoolkit.train.run import train

    t0 = time.monotonic()
    cfg = ctx.cfg
    # The store handed this attempt's samples out once; what an earlier attempt trained on up to
    # its checkpoint is in that checkpoint's ledger, and the engines capture only the rest.
    done = ledger.attempt_ledger(ctx.run)
    rank0 = proc.node_rank == 0
    if rank0 and cfg.data.offline_dir:
        say(f"WARNING: data.offline_dir has no effect on a live run; each rank spools to {ctx.run.spool}")
    if rank0 and done is not None:
        say(f"resuming from {done.checkpoint.name}: {len(done.prompts)} prompts trained on already")
    attempt = ledger.attempt_run_id(ctx.run_id, ctx.slurm.job_id if ctx.slurm else None)
    prefixes = tuple(run_prefix(attempt, i) for i in range(cfg.engine.num_engines))
    wait_reachable(store_address(ctx), MASTER_REACH_TIMEOUT_S)
    source = _live_source(ctx, prefixes, done)
    cfg = counted_vocab(ctx, cfg, prefixes, announce=rank0)
    watch = _DrainWatch(ctx, source, _metrics_address(ctx) if rank0 else None, t0)
    if rank0:
        watch.thread.start()
    try:
        result = train(cfg, source, ctx.run.train, progress_file=ctx.run.progress("trainer"))
    except BaseException as err:
        if rank0:
            write_json_atomic(ctx.run.ended, {"ok": False, "error": f"{type(err).__name__}: {err}"})
        raise
    finally:
        watch.close()
    if preempt.requested():
        return _preempted(ctx, proc, result)
    if rank0:
        watch.thread.join(timeout=30)
        _finish(ctx, _live_summary(ctx, source, watch, prefixes, result, t0))
    return 0


def counted_vocab(ctx: NodeContext, cfg: Any, prefixes: Sequence[str], *, announce: bool = False) -> Any:
    """`cfg`, with `data.draft_vocab` set to the pruned vocabulary chosen from the engines' counts
    of every sample's supervised tokens when the draft prunes its vocabulary and the recipe names
    none (a live store hands each sample out once, so the trainers cannot count them first). Every
    rank chooses the same ids from the same counts; the file is `manifests/draft_vocab.json`."""
    import dataclasses
    from collections import Counter

    import torch

    from hpctoolkit.models.common.vocab import draft_vocab_from_counts
    from hpctoolkit.models.registry import load_draft_config
    from hpctoolkit.train.build import needs_vocab_counts

    draft = load_draft_config(cfg.draft.config)
    if cfg.data.draft_vocab or not needs_vocab_counts(draft):
        return cfg
    total: Counter[int] = Counter()
    samples = 0
    for engine, prefix in enumerate(prefixes):
        rec = _wait_vocab_counts(ctx, engine, prefix)
        samples += int(rec["samples"])
        total.update({int(k): int(v) for k, v in rec["counts"].items()})
    counts = torch.zeros(draft.vocab_size, dtype=torch.float64)
    if total:
        ids = torch.tensor(list(total), dtype=torch.long)
        if int(ids.max()) >= draft.vocab_size:
            raise ConfigError(
                f"the engines counted token id {int(ids.max())}, outside the draft's vocab_size={draft.vocab_size}"
            )
        counts[ids] = torch.tensor(list(total.values()), dtype=torch.float64)
    chosen = draft_vocab_from_counts(counts, draft.draft_vocab_size)
    body = {
        "vocab_size": draft.vocab_size,
        "draft_vocab_size": draft.draft_vocab_size,
        "source": f"the engines' counts of the supervised tokens of all {samples} samples",
        "target_ids": chosen.tolist(),
    }
    write_json_atomic(ctx.run.engine_vocab, body)  # every rank writes the same ids
    if announce:
        say(f"pruned vocabulary: {draft.draft_vocab_size} of {draft.vocab_size} ids from {body['source']}")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, draft_vocab=str(ctx.run.engine_vocab)))


def _wait_vocab_counts(ctx: NodeContext, engine: int, prefix: str) -> dict[str, Any]:
    """Engine `engine`'s counts of this attempt (bounded as the queues are; its failure named)."""
    deadline = time.monotonic() + QUEUE_STALL_TIMEOUT_S
    while True:
        rec = read_json(ctx.run.vocab_counts(engine))
        if isinstance(rec, dict) and rec.get("run_prefix") == prefix:
            return rec
        failed = read_json(ctx.run.queue_failed(engine))
        if isinstance(failed, dict) and failed.get("run_prefix") == prefix:
            raise DataIntegrityError(
                f"engine {engine} failed before it counted its samples: {failed.get('error')}"
            )
        if time.monotonic() > deadline:
            raise DataIntegrityError(
                f"{ctx.run.vocab_counts(engine)} did not appear within {QUEUE_STALL_TIMEOUT_S:.0f}s "
                "(the pruned vocabulary is chosen from it)"
            )
        time.sleep(0.5)


def _live_summary(
    ctx: NodeContext, source: Any, watch: _DrainWatch, prefixes: tuple[str, ...], result: Any, t0: float
) -> dict[str, Any]:
    world = ctx.plan.trainer.world_size
    deadline = time.monotonic() + READ_RECORDS_TIMEOUT_S
    published = _published(ctx, prefixes)
    read, moved, complete = _read_totals(source, world)
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
        read, moved, complete = _read_totals(source, world)
    keys_left = watch.result.get("keys_left_in_store")
    if keys_left is None:
        keys_left = _count_keys(watch.metrics)
    summary = {
        "recipe": ctx.cfg.name,
        "run_id": ctx.run_id,
        "samples_published": published,
        "samples_read": read,
        "bytes_moved": moved,
        "keys_left_in_store": keys_left,
        **_train_fields(ctx, result),
        "drained_after_s": round(watch.result["at_s"], 1) if "at_s" in watch.result else None,
        "train_wall_seconds": round(time.monotonic() - t0, 1),
        **_hosts(ctx, source),
        **synthesized_fields(ctx.run),
        **phase_fields(ctx.run, train=time.monotonic() - t0),
    }
    if published is None or read != published:
        # Not an error (training.steps may end before one pass), but never silent.
        summary["samples_unread"] = None if published is None else published - read
        say(f"WARNING: trained on {read} of {published} published samples; the rest were never read")
    return summary


def _finish(ctx: NodeContext, summary: dict[str, Any]) -> None:
    """Rank 0's last word: the summary, then the services' cue to stop; `latest` too when no
    evaluate role follows (`roles.results`). An earlier attempt's figures are kept (`rundir.summary`)."""
    summary = carry_forward(summary, read_json(ctx.run.summary_earlier))
    write_json_atomic(ctx.run.summary, summary, indent=2)
    write_json_atomic(ctx.run.ended, {"ok": True})
    if trainers_are_last(ctx.cfg):
        finished(ctx.run)
    say(
        f"trained {summary.get('steps_trained')} steps on {summary.get('samples_read')} samples; "
        f"final loss {figure(summary.get('final_loss'))}; keys left in store {summary.get('keys_left_in_store')}; "
        + trainer_acceptance_line(summary)
    )
