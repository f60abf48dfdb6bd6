"""The `master` role: launch the Mooncake master, record its addresses in the run directory, and
stay up until the run ends (the trainers' `ended.json`, then every engine's close record, at most
`ENGINES_CLOSE_TIMEOUT_S` after it), this process is told to stop, or the job's time limit passes
(under Slurm: Slurm ends the step; a dead peer ends it sooner, `plan.lifecycle`'s watch).

Under submitit the master is global task 0, whose SIGUSR2 handler (submitit's, which the master
leaves alone) requeues the job. A run on an external master (`store.master_address`) places no
master; task 0 then runs `run_watcher` in its slot (`slurm.tasks.task_process`).
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import replace

from hpctoolkit.config.fields import slurm_time_seconds
from hpctoolkit.errors import ConfigError, StoreError
from hpctoolkit.output.console import speaker
from hpctoolkit.plan import lifecycle
from hpctoolkit.plan.placement import Process
from hpctoolkit.roles.context import NodeContext, master_bind_host
from hpctoolkit.roles.waits import term_event
from hpctoolkit.rundir import ledger
from hpctoolkit.rundir.atomic import read_json, write_json_atomic
from hpctoolkit.store.mooncake_master import resolve_master

# How often the master looks for the end of the run.
END_POLL_S = 0.5


say = speaker("master")


# Once the trainers ended, the engines' close records within the drain's grace, and then some.
ENGINES_CLOSE_TIMEOUT_S = lifecycle.ENGINES_DRAIN_GRACE_S + 2 * lifecycle.STOP_GRACE_S


def _open_engines(ctx: NodeContext) -> list[int] | None:
    """None before the trainers ended; then the engines still holding a store segment."""
    if read_json(ctx.run.ended) is None:
        return None
    return [e.index for e in ctx.plan.engines if read_json(ctx.run.engine_closed(e.index)) is None]


def _deadline(ctx: NodeContext) -> float:
    """When this process stops waiting for the run's end on its own. Under Slurm never: Slurm ends
    the job's steps at the job's limit, which an operator may have changed since submission
    (`scontrol update TimeLimit`, also while a requeued job waits), so the recipe's `cluster.time`
    is only what was asked for. Elsewhere, `cluster.time` from this start."""
    if ctx.slurm is not None:
        return math.inf
    return time.monotonic() + slurm_time_seconds(ctx.cfg.cluster.time)


def run_master(ctx: NodeContext, proc: Process) -> int:
    m = ctx.plan.master
    if m is None:
        raise ConfigError(
            "store.master_address is set: this run connects to an external master, none runs here"
        )
    store_cfg = replace(ctx.cfg.store, bind_host=master_bind_host(ctx), master_port=m.port)
    stop = term_event()
    if signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL:
        # Not under submitit (whose handler requeues): a preemption notice sent to every step
        # must not end the store while the trainers checkpoint; the run's end ends the master.
        signal.signal(signal.SIGUSR2, lambda *_: say("SIGUSR2: staying up until the run ends"))
    with resolve_master(store_cfg, ctx.run.logs) as master:
        # The metrics port is picked at start; trainers count the keys left through it.
        record = {"run_id": ctx.run_id, "address": master.address, "metrics_address": master.metrics_address}
        write_json_atomic(ctx.run.master_record, record)
        say(f"Mooncake master at {master.address} on {ctx.nodename}")
        deadline = _deadline(ctx)
        ended_at: float | None = None
        while not stop.wait(END_POLL_S):
            engines = _open_engines(ctx)
            if engines == []:
                say("the trainers are done and every engine has left; stopping")
                break
            if engines is not None:
                ended_at = ended_at or time.monotonic()
                if time.monotonic() - ended_at > ENGINES_CLOSE_TIMEOUT_S:
                    say(
                        f"the trainers are done but engine(s) {engines} did not close their store segments "
                        f"within {ENGINES_CLOSE_TIMEOUT_S}s; stopping"
                    )
                    break
            if not master.alive():
                raise StoreError(
                    f"the Mooncake master at {master.address} exited during the run; see {ctx.run.logs}"
                )
            if time.monotonic() > deadline:
                say("the run's time limit passed; stopping")
                break
    return 0


def run_watcher(ctx: NodeContext) -> int:
    """Task 0 of a submitit job without a master of its own: keep submitit's SIGUSR2 handler (it
    calls `RoleTask.checkpoint`, which waits for the trainers' checkpoint, then requeues the job)
    and wait for the run's end, this process being told to stop, or the time limit."""
    stop = term_event()
    deadline = _deadline(ctx)
    say(f"watching run {ctx.run_id} for its end on {ctx.nodename} (submitit requeues on SIGUSR2 here)")
    while not stop.wait(END_POLL_S):
        ended = read_json(ctx.run.ended)
        if isinstance(ended, dict) and ended.get("preempted"):
            # The trainers checkpointed on a notice this task never got (a SIGUSR2 sent to a rank
            # alone): hand it to submitit's handler, as if it had come here too.
            handler = signal.getsignal(signal.SIGUSR2)
            if callable(handler):
                say("the trainers checkpointed on SIGUSR2; asking submitit to requeue the job")
                os.kill(os.getpid(), signal.SIGUSR2)
            return ledger.PREEMPTED_EXIT
        if isinstance(ended, dict):
            say("the trainers are done; stopping")
            break
        if time.monotonic() > deadline:
            say("the run's time limit passed; stopping")
            break
    return 0
