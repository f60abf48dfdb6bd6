"""The trainer role's job, built from the run context in one step (`trainer_job`).

The builder does what a rank needs before it trains, in order and once: the rendezvous (rank 0
listens and records its port; `os.environ` gets torch.distributed's variables), then for a live
run the store's address (waited for until the master answers), the sizing, the ledger this
attempt resumes from, the pruned vocabulary the engines counted, and the source that reads the
engines' queues; then the plan's share in the summary (which roles ran where, which ranks read
across hosts: `rundir.summary.TrainerReport`), and last the target (a packaged one converted on
first use). What it returns is all `roles.trainer` hands to `train.run.train_on` and reports from.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctoolkit import envs
from hpctoolkit.errors import ConfigError
from hpctoolkit.output.console import speaker
from hpctoolkit.plan.placement import Plan, Process
from hpctoolkit.roles.context import (
    NodeContext,
    client_store_config,
    read_master_record,
    store_address,
    trainer_env,
    trainer_rendezvous,
)
from hpctoolkit.roles.results import trainers_are_last
from hpctoolkit.roles.waits import MASTER_REACH_TIMEOUT_S, wait_reachable
from hpctoolkit.rundir import ledger
from hpctoolkit.rundir.layout import RunDir
from hpctoolkit.rundir.summary import TrainerReport
from hpctoolkit.targets.resolve import resolve_target

# No new manifest from any engine for this long (engine start included) fails the read.
QUEUE_STALL_TIMEOUT_S = 1800.0

say = speaker("trainer")


@dataclass(frozen=True)
class TrainerJob:
    """What one trainer rank trains on and where it reports: metadata only (the samples travel
    through the store), built once by `trainer_job`."""

    cfg: Any  # the recipe; a live run's carries the pruned vocabulary the engines counted
    samples: Any  # the offline shard folder, or a live run's `LiveSource`
    target_dir: Path  # the target's checkpoint directory (`targets.resolve.resolve_target`)
    run: RunDir
    run_id: str
    report: TrainerReport  # what rank 0's summary takes besides training's result
    rank0: bool
    t0: float  # when the rank began its job (after the rendezvous)
    prefixes: tuple[str, ...] = ()  # a live run's engine queues of this attempt
    metrics: str | None = None  # rank 0 of a live run: the master's metrics address, if known

    @property
    def live(self) -> bool:
        return bool(self.prefixes)


def trainer_job(ctx: NodeContext, proc: Process) -> TrainerJob:
    """Join the rendezvous and build this rank's job (a live run waits for the master here)."""
    cfg = ctx.cfg
    # One process per rank; train() joins env:// when RANK/WORLD_SIZE are set. Rank 0's store
    # serves on the socket it already listens on: the data-plane address, never all interfaces.
    rendezvous, listening = trainer_rendezvous(ctx, proc)
    os.environ.update(trainer_env(ctx, proc, rendezvous))
    if listening is not None:
        # Handed over: the store owns the descriptor from here (train.fsdp).
        os.environ[envs.HPCTOOLKIT_RENDEZVOUS_FD.name] = str(listening.detach())
    rank0 = proc.node_rank == 0
    t0 = time.monotonic()
    live = cfg.training.data_source != "offline"
    if not live and not cfg.data.offline_dir:
        raise ConfigError("training.data_source=offline needs data.offline_dir (the shard folder)")
    samples: Any = cfg.data.offline_dir
    prefixes: tuple[str, ...] = ()
    metrics: str | None = None
    if live:
        cfg, samples, prefixes, metrics = _live_source(ctx, rank0)
    report = trainer_report(ctx, prefixes)
    try:
        target_dir = resolve_target(str(cfg.paths.target_model))  # a packaged one converted here, once
    except BaseException as err:
        if live and rank0:  # as a failed training does: the services' cue to stop
            ledger.end_failed(ctx.run, err)
        raise
    return TrainerJob(cfg, samples, target_dir, ctx.run, ctx.run_id, report, rank0, t0, prefixes, metrics)


def _master_addresses(ctx: NodeContext, rank0: bool) -> tuple[str, str | None]:
    """The store's address, once the master answers there, and on rank 0 its metrics address."""
    address = store_address(ctx)
    wait_reachable(address, MASTER_REACH_TIMEOUT_S)
    if not rank0:
        return address, None
    if ctx.plan.master is None:
        return address, ctx.cfg.store.master_metrics_address
    return address, read_master_record(ctx)["metrics_address"]


def _live_source(ctx: NodeContext, rank0: bool) -> tuple[Any, Any, tuple[str, ...], str | None]:
    """A live run's recipe (with the pruned vocabulary the engines counted), its `LiveSource`, this
    attempt's engine queues and, on rank 0, the master's metrics address."""
    from hpctoolkit.engine.kwargs import run_prefix
    from hpctoolkit.plan.sizing import check_counts
    from hpctoolkit.store.mooncake import MooncakeStore
    from hpctoolkit.train.source import LiveSource, ManifestQueues
    from hpctoolkit.train.vocab_counts import counted_vocab

    store_cfg = client_store_config(ctx)
    address, metrics = _master_addresses(ctx, rank0)
    cfg = ctx.cfg
    # One pass spools nothing; replays are bounded (plan.sizing checked both at load).
    epochs = check_counts(cfg).epochs
    run = ctx.run
    # The store handed this attempt's samples out once; what an earlier attempt trained on up to
    # its checkpoint is in that checkpoint's ledger, and the engines capture only the rest.
    done = ledger.attempt_ledger(run)
    if rank0 and cfg.data.offline_dir:
        say(f"WARNING: data.offline_dir has no effect on a live run; each rank spools to {run.spool}")
    if rank0 and done is not None:
        say(f"resuming from {done.checkpoint.name}: {len(done.prompts)} prompts trained on already")
    attempt = ledger.attempt_run_id(ctx.run_id, ctx.slurm.job_id if ctx.slurm else None)
    n = cfg.engine.num_engines
    expected = tuple(len(ledger.remaining(range(i, cfg.data.num_samples, n), done)) for i in range(n))
    prefixes = tuple(run_prefix(attempt, i) for i in range(n))
    counted = counted_vocab(cfg, run, prefixes, QUEUE_STALL_TIMEOUT_S, announce=rank0)
    if rank0 and ctx.plan.master is None and metrics is None:
        say(
            "WARNING: store.master_metrics_address is unset: summary.json cannot count the keys "
            f"left in the external master at {cfg.store.master_address} (keys_left_in_store: null)"
        )
    source = LiveSource(
        "",
        expected=sum(expected),
        store_factory=functools.partial(MooncakeStore, address, store_cfg, role="reader"),
        retry_max_wait_s=cfg.store.get_retry_max_wait_seconds,
        follow=ManifestQueues(str(run.root), prefixes, expected, QUEUE_STALL_TIMEOUT_S),
        spool_dir=str(run.spool),
        epochs=epochs,
        spool_max_bytes=cfg.training.spool_max_size,
        engine_prefixes=prefixes,
        resumed=done is not None,
        device="cuda" if cfg.training.device == "cuda" else None,
        # Two batches fetched and checked ahead of the step that takes them: the host reads the
        # next batch whole while the GPU trains on this one (`benchmarks/trainer_input.py`).
        read_ahead=max(8, 2 * cfg.training.batch_size),
        seed=cfg.training.seed,
    )
    return counted, source, prefixes, metrics


def trainer_report(ctx: NodeContext, prefixes: tuple[str, ...] = ()) -> TrainerReport:
    """What rank 0 reports from besides training's result, the plan's part taken now."""
    plan: Plan = ctx.plan
    engine_nodes = {n.node for e in plan.engines for n in e.nodes}
    return TrainerReport(
        ctx.run,
        ctx.cfg.name,
        ctx.run_id,
        ctx.cfg.evaluate.num_speculative_tokens,
        trainers_are_last(ctx.cfg),
        world_size=plan.trainer.world_size,
        prefixes=prefixes,
        node_roles=tuple(tuple(sorted({p.role for p in plan.on_node(n)})) for n in range(plan.num_nodes)),
        remote_ranks=tuple(r.rank for r in plan.trainer.ranks if r.node not in engine_nodes),
    )
