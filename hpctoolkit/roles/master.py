"""The `master` role: launch the Mooncake master, record its addresses in the run directory, and
stay up until the run ends (the trainers' `ended.json`), this process is told to stop, or the
job's time limit passes."""

from __future__ import annotations

import time
from dataclasses import replace

from hpctoolkit.errors import ConfigError, StoreError
from hpctoolkit.plan.placement import Process
from hpctoolkit.roles.context import NodeContext, master_bind_host
from hpctoolkit.roles.waits import term_event
from hpctoolkit.rundir.atomic import read_json, write_json_atomic
from hpctoolkit.slurm.env import time_limit_minutes
from hpctoolkit.store.master import resolve_master

# How often the master looks for the end of the run.
END_POLL_S = 0.5


def say(msg: str) -> None:
    print(f"[hpctoolkit.master] {msg}", flush=True)


def _run_over(ctx: NodeContext) -> bool:
    """The trainers ended and no engine still holds a store segment."""
    if read_json(ctx.run.ended) is None:
        return False
    return all(read_json(ctx.run.engine_closed(e.index)) is not None for e in ctx.plan.engines)


def run_master(ctx: NodeContext, proc: Process) -> int:
    m = ctx.plan.master
    if m is None:
        raise ConfigError(
            "store.master_address is set: this run connects to an external master, none runs here"
        )
    store_cfg = replace(ctx.cfg.store, bind_host=master_bind_host(ctx), master_port=m.port)
    stop = term_event()
    with resolve_master(store_cfg, ctx.run.logs) as master:
        # The metrics port is picked at start; trainers count the keys left through it.
        record = {"run_id": ctx.run_id, "address": master.address, "metrics_address": master.metrics_address}
        write_json_atomic(ctx.run.master_record, record)
        say(f"Mooncake master at {master.address} on {ctx.nodename}")
        deadline = time.monotonic() + 60.0 * time_limit_minutes(ctx.cfg.cluster.time)
        while not stop.wait(END_POLL_S):
            if _run_over(ctx):
                say("the trainers are done and every engine has left; stopping")
                break
            if not master.alive():
                raise StoreError(
                    f"the Mooncake master at {master.address} exited during the run; see {ctx.run.logs}"
                )
            if time.monotonic() > deadline:
                say("the job's time limit passed; stopping")
                break
    return 0
