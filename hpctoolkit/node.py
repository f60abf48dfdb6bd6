"""`python -m hpctoolkit.node ROLE RECIPE [section.key=value ...]`: one role on one node.

Roles: `check` (load the recipe, plan, compare with the script's digest; run by the batch shell
before any step), `master`, `engine-leader`, `engine-follower`, `trainer`. Each batch-script step
runs one role; which engine, node_rank or FSDP rank it is comes from the plan and the Slurm
environment (`SLURMD_NODENAME` in the job's node list, `SLURM_PROCID`), never from hand-passed
numbers, and a process that finds itself where the plan did not put it exits non-zero.

`HPCTOOLKIT_NODE_DRY=1` replaces every role's work with one line
`role=<role> node=<SLURMD_NODENAME> engine=<i> node_rank=<r> gpus=<CUDA_VISIBLE_DEVICES> ...`
and exit 0: the real-Slurm tests use it to prove placement on machines without GPUs.

Under submitit (`run_task`) every task of the job calls the same function; the task's position
on its node (`SLURM_LOCALID`) picks one of the plan's processes on that node, and spare tasks
return at once.

How the real roles meet (everything through the run's output directory, which every node shares,
and the Mooncake master; see `hpctoolkit.capture.queue` for the files):

* `master` launches the Mooncake master, records its addresses in `<output_dir>/master.json`,
  and stays up until the batch script ends it after the trainers (at most the job's time limit).
* `engine-leader` (engine i, node_rank 0) builds `CaptureEngine`, captures prompts `i::num_engines`
  of `data.prompts` one request per `generate()` call, appends each manifest to
  `manifests/engine<i>.jsonl`, writes `engine<i>.done`, and keeps its store segment (where the
  fragments live) until the trainers write `manifests/drained`.
* `engine-follower` starts a `HeadlessFollower` with the leader's kwargs (both come from
  `engine_llm_kwargs` with `engine_node_args`) and serves until its leader leaves.
* `trainer` ranks read every engine's queue through `LiveSource` (each rank fetches its share and
  spools it for later epochs), train, checkpoint and export; rank 0 writes `drained` once every
  rank read its whole share, and `<output_dir>/summary.json` at the end.

The run id (`<recipe name>-j<SLURM_JOB_ID>`) prefixes every sample key and record, so files an
earlier job left in the same output directory are never taken for this one's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hpctoolkit import envs
from hpctoolkit.cli import run_cli
from hpctoolkit.engine.env import available_cores, detect_backend
from hpctoolkit.errors import ConfigError, DataIntegrityError, StoreError
from hpctoolkit.plan.placement import (
    LOCALHOST,
    ROLE_ENGINE_FOLLOWER,
    ROLE_ENGINE_LEADER,
    ROLE_MASTER,
    ROLE_TRAINER,
    ROLES,
    Plan,
    Process,
    make_plan,
)
from hpctoolkit.slurm.env import SlurmEnvironment

ROLE_CHECK = "check"
# A role waits at most this long for the master, started by a step of its own at the same time
# (it imports torch and spawns the binary).
DRY_REACH_TIMEOUT_S = 90.0
# Bounds of the real roles' waits (each failure names what it waited for).
MASTER_RECORD_TIMEOUT_S = 120.0  # trainers: the master's address record of this run
QUEUE_STALL_TIMEOUT_S = 1800.0  # trainers: no new manifest from any engine (engine start included)
DRAIN_TIMEOUT_S = 3600.0  # leaders: the trainers' `drained` record after the last capture
READ_RECORDS_TIMEOUT_S = 300.0  # trainer rank 0: the other ranks' read records after training
MASTER_RECORD = "master.json"


@dataclass(frozen=True)
class NodeContext:
    """Where this process runs: the plan, its node index, and the hosts of the allocation."""

    cfg: Any  # RecipeConfig
    plan: Plan
    node: int
    hosts: tuple[str, ...]
    nodename: str
    slurm: SlurmEnvironment | None

    def host(self, node: int) -> str:
        return self.hosts[node]


def load_context(
    recipe: str, overrides: Sequence[str], environ: Mapping[str, str] | None = None
) -> NodeContext:
    from hpctoolkit.config.load import load_recipe

    env = os.environ if environ is None else environ
    cfg = load_recipe(recipe, list(overrides))
    plan = make_plan(cfg)
    want = env.get(envs.HPCTOOLKIT_PLAN_DIGEST.name)
    if want and want != plan.digest():
        raise ConfigError(
            f"the batch script was rendered for placement {want}, but {recipe} with these overrides "
            f"plans {plan.digest()}; re-render it (python -m hpctoolkit.submit {recipe} --render-sbatch)"
        )
    if SlurmEnvironment.detected(env):
        senv = SlurmEnvironment.from_env(env)
        if len(senv.nodelist) != plan.num_nodes:
            raise ConfigError(
                f"the job has {len(senv.nodelist)} node(s) but the plan places {plan.num_nodes}"
            )
        return NodeContext(cfg, plan, senv.node_index, senv.nodelist, senv.nodename or "?", senv)
    if plan.backend != "local":
        raise ConfigError("the slurm backend's roles run inside a Slurm job (SLURM_JOB_ID is unset)")
    return NodeContext(cfg, plan, 0, (LOCALHOST,), LOCALHOST, None)


def select_process(ctx: NodeContext, role: str) -> Process:
    """The plan's process for `role` on this node (for trainers: this task's rank)."""
    here = [p for p in ctx.plan.on_node(ctx.node) if p.role == role]
    if role == ROLE_TRAINER:
        rank = ctx.slurm.proc_id if ctx.slurm else 0
        here = [p for p in here if p.node_rank == rank]
    if not here:
        raise ConfigError(
            f"the plan puts no {role} on node n{ctx.node} ({ctx.nodename})"
            + (f" for rank {ctx.slurm.proc_id}" if role == ROLE_TRAINER and ctx.slurm else "")
            + "; the step landed where the plan did not place it"
        )
    if len(here) > 1:
        raise ConfigError(f"the plan puts {len(here)} {role} processes on node n{ctx.node}; pass which one")
    proc = here[0]
    if role == ROLE_TRAINER and ctx.slurm and proc.local_rank != ctx.slurm.local_id:
        raise ConfigError(
            f"trainer rank {proc.node_rank} is planned as local rank {proc.local_rank} on n{ctx.node} "
            f"but Slurm made it local task {ctx.slurm.local_id}"
        )
    return proc


def dry_line(ctx: NodeContext, proc: Process, environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    gpus = env.get("CUDA_VISIBLE_DEVICES") or "-"
    fields = [
        f"role={proc.role}",
        f"node={ctx.nodename}",
        f"engine={'-' if proc.engine is None else proc.engine}",
    ]
    if proc.role == ROLE_TRAINER:
        t = ctx.plan.trainer
        fields += [
            f"node_rank={t.nodes.index(proc.node)}",
            f"gpus={gpus}",
            f"rank={proc.node_rank}",
            f"local_rank={proc.local_rank}",
            f"planned_gpus={','.join(map(str, proc.gpus)) or '-'}",
        ]
    else:
        fields += [
            f"node_rank={'-' if proc.node_rank is None else proc.node_rank}",
            f"gpus={gpus}",
            f"planned_gpus={','.join(map(str, proc.gpus)) or '-'}",
        ]
    fields.append(f"index={proc.node}")
    return " ".join(fields)


def trainer_env(ctx: NodeContext, proc: Process) -> dict[str, str]:
    """torch.distributed's variables for one FSDP rank; pure."""
    t = ctx.plan.trainer
    return {
        "RANK": str(proc.node_rank),
        "LOCAL_RANK": str(proc.local_rank),
        "WORLD_SIZE": str(t.world_size),
        "LOCAL_WORLD_SIZE": str(t.ranks_per_node),
        "MASTER_ADDR": ctx.host(t.nodes[0]),
        "MASTER_PORT": str(t.master_port),
    }


def store_address(ctx: NodeContext) -> str:
    """host:port every engine and trainer uses to reach the Mooncake master."""
    plan = ctx.plan
    if plan.external_master:
        return plan.external_master
    if plan.master is None:  # pragma: no cover - make_plan always sets one of the two
        raise AssertionError("plan has neither a master nor an external master")
    return f"{master_bind_host(ctx)}:{plan.master.port}"


def master_bind_host(ctx: NodeContext) -> str:
    """The address the master binds and everyone dials: the recipe's, or its node's host name
    resolved to an address (the same lookup on every node of the job)."""
    m = ctx.plan.master
    if m is None:
        raise ConfigError("store.master_address is set: this run connects to an external master")
    if m.bind_host:
        return m.bind_host
    host = ctx.host(m.node)
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def _term_event() -> threading.Event:
    """An event set when the batch script ends this step (SIGTERM) or it is interrupted."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    return done


def _wait_for_term(timeout_s: float | None = None) -> bool:
    """Block a service role until SIGTERM/SIGINT (True) or `timeout_s` passed (False)."""
    return _term_event().wait(timeout_s)


def _job_time_limit_s(ctx: NodeContext) -> float:
    from hpctoolkit.slurm.submit import _timeout_min

    return 60.0 * _timeout_min(ctx.cfg.cluster.time)


def say(msg: str) -> None:
    print(f"[hpctoolkit.node] {msg}", flush=True)


def run_id(ctx: NodeContext) -> str:
    """Unique per job and the same on every node of it: prefixes sample keys and records."""
    job = ctx.slurm.job_id if ctx.slurm else "local"
    return f"{ctx.cfg.name}-j{job}"


def engine_share(num_samples: int, num_engines: int, engine: int) -> int:
    """How many of the run's prompts engine `engine` captures (prompts `engine::num_engines`)."""
    return len(range(engine, num_samples, num_engines))


def node_address(host: str) -> str:
    """`host` as an address (the same lookup on every node); the name itself if it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def engine_node_args(ctx: NodeContext, proc: Process) -> dict[str, Any]:
    """This engine node's keywords for `engine_llm_kwargs` (and `CaptureEngine`) beyond the shared
    ones: its address, its cores, and for a multi-node engine its node_rank and the rendezvous."""
    e = ctx.plan.engines[proc.engine]
    args: dict[str, Any] = {"engine_index": e.index}
    if ctx.slurm is not None:
        # The node's own address and cores: vLLM and gloo bind the one, the workers split the other.
        args.update(host_ip=node_address(ctx.nodename), cores=available_cores())
    if e.nnodes > 1:
        args.update(
            node_rank=proc.node_rank,
            master_addr=node_address(ctx.host(e.leader.node)),
            master_port=e.master_port,
        )
    return args


def _run_master(ctx: NodeContext, proc: Process) -> int:
    from hpctoolkit.store.master import resolve_master

    m = ctx.plan.master
    if m is None:
        raise ConfigError(
            "store.master_address is set: this run connects to an external master, none runs here"
        )
    store_cfg = replace(ctx.cfg.store, bind_host=master_bind_host(ctx), master_port=m.port)
    out = Path(ctx.cfg.paths.output_dir)
    with resolve_master(store_cfg, out / "logs") as master:
        # The metrics port is picked at start; trainers count the keys left through it.
        record = {"run_id": run_id(ctx), "address": master.address, "metrics_address": master.metrics_address}
        tmp = out / f".{MASTER_RECORD}.tmp"
        tmp.write_text(json.dumps(record))
        tmp.replace(out / MASTER_RECORD)
        print(f"mooncake master at {master.address} on {ctx.nodename}", flush=True)
        # Ended by the batch script once the trainers exit; never outlives the job's time limit.
        if not _wait_for_term(_job_time_limit_s(ctx)):
            print("mooncake master: the job's time limit passed; stopping", flush=True)
    return 0


def _run_engine_leader(ctx: NodeContext, proc: Process) -> int:
    from transformers import AutoTokenizer

    from hpctoolkit.capture.queue import QueueWriter, wait_drained
    from hpctoolkit.engine.engine import CaptureEngine, run_prefix
    from hpctoolkit.pipeline.prompts import load_prompt_ids
    from hpctoolkit.testing.tiny_target import resolve_target

    cfg = ctx.cfg
    e = ctx.plan.engines[proc.engine]
    out = Path(cfg.paths.output_dir)
    rid = run_id(ctx)
    queue = QueueWriter(out, e.index, run_prefix(rid, e.index))
    # First thing: an earlier job's queue must not look like this one's to a trainer.
    queue.reset()
    stop = _term_event()
    try:
        # The master's step starts with this one: wait for it rather than fail the engine's own
        # reachability check (which bounds a master that went away, not one still starting).
        wait_reachable(store_address(ctx), DRY_REACH_TIMEOUT_S)
        target_dir = resolve_target(cfg.paths.target_model)
        tok = AutoTokenizer.from_pretrained(target_dir)
        prompts = load_prompt_ids(cfg.data.prompts, tok, cfg.data.num_samples, cfg.data.max_prompt_tokens)
        mine = prompts[e.index :: cfg.engine.num_engines]
        t0 = time.monotonic()
        with CaptureEngine(
            cfg.engine,
            target_dir,
            store_address(ctx),
            cfg.store,
            rid,
            output_dir=out,
            **engine_node_args(ctx, proc),
        ) as eng:
            started = time.monotonic() - t0
            bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "-") if eng.backend == "cpu" else "-"
            say(
                f"engine {e.index} node_rank 0 up in {started:.1f}s on {ctx.nodename} (cpu bind {bind}); "
                f"capturing {len(mine)} prompts"
            )
            batch = cfg.engine.capture_batch
            for i in range(0, len(mine), batch):
                if stop.is_set():
                    raise DataIntegrityError(
                        f"engine {e.index} stopped after {queue.published} of {len(mine)} samples"
                    )
                # A batch's manifests come back once all of its fragments are published.
                for m in eng.capture(mine[i : i + batch]):
                    queue.append(m.to_json())
            queue.done()
            say(
                f"engine {e.index} published {queue.published} samples in {time.monotonic() - t0 - started:.1f}s"
            )
            # The fragments live in this engine's store segments: keep them until read.
            wait_drained(out, rid, DRAIN_TIMEOUT_S, stop)
            say(f"engine {e.index}: the trainers drained every sample; shutting down")
            t1 = time.monotonic()
    except BaseException as err:
        queue.failed(f"{type(err).__name__}: {err}")
        raise
    say(f"engine {e.index} shut down in {time.monotonic() - t1:.1f}s")
    return 0


def _run_engine_follower(ctx: NodeContext, proc: Process) -> int:
    from hpctoolkit.engine.engine import engine_llm_kwargs, fault_dir_for
    from hpctoolkit.engine.follower import NODE_KEYS, HeadlessFollower
    from hpctoolkit.testing.tiny_target import resolve_target

    cfg = ctx.cfg
    e = ctx.plan.engines[proc.engine]
    wait_reachable(store_address(ctx), DRY_REACH_TIMEOUT_S)  # its workers connect at start
    target_dir = resolve_target(cfg.paths.target_model)
    # The leader's CaptureEngine makes this same call; only the node keys differ.
    _, kwargs, env = engine_llm_kwargs(
        cfg.engine,
        target_dir,
        store_address(ctx),
        cfg.store,
        run_id(ctx),
        backend=detect_backend(),
        fault_dir=fault_dir_for(cfg.paths.output_dir, e.index),
        **engine_node_args(ctx, proc),
    )
    os.environ.update(env)
    follower = HeadlessFollower(
        {k: v for k, v in kwargs.items() if k not in NODE_KEYS},
        node_rank=kwargs["node_rank"],
        nnodes=kwargs["nnodes"],
        master_addr=kwargs["master_addr"],
        master_port=kwargs["master_port"],
    )
    stop = _term_event()
    try:
        follower.start()  # returns once this node's workers joined the leader
        say(
            f"engine {e.index} node_rank {proc.node_rank} serving on {ctx.nodename} "
            f"(cpu bind {env.get('VLLM_CPU_OMP_THREADS_BIND', '-')})"
        )
        follower.wait(stop, poll_s=2.0)  # until the leader leaves or the step is ended
    finally:
        follower.shutdown()
    return 0


def _master_metrics_address(ctx: NodeContext, rid: str) -> str | None:
    """The metrics address of this run's master: its record (launched) or the recipe's (external)."""
    if ctx.plan.master is None:
        return ctx.cfg.store.master_metrics_address
    path = Path(ctx.cfg.paths.output_dir) / MASTER_RECORD
    deadline = time.monotonic() + MASTER_RECORD_TIMEOUT_S
    while True:
        try:
            record = json.loads(path.read_text())
            if record.get("run_id") == rid:
                return record["metrics_address"]
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise StoreError(
                f"the Mooncake master of run {rid} did not write {path} within {MASTER_RECORD_TIMEOUT_S:.0f}s"
            )
        time.sleep(0.2)


def _read_totals(source: Any, world_size: int) -> tuple[int, int, bool]:
    """(samples, bytes, every rank complete) from the ranks' read records."""
    n = nbytes = 0
    complete = True
    for r in range(world_size):
        try:
            rec = json.loads(source.read_record(r).read_text())
        except (OSError, ValueError):
            rec = {}
        n += int(rec.get("samples", 0))
        nbytes += int(rec.get("bytes", 0))
        complete = complete and bool(rec.get("complete"))
    return n, nbytes, complete


def _published(out: Path, prefixes: Sequence[str]) -> int | None:
    from hpctoolkit.capture.queue import done_path

    total = 0
    for i, prefix in enumerate(prefixes):
        try:
            rec = json.loads(done_path(out, i).read_text())
        except (OSError, ValueError):
            return None
        if rec.get("run_prefix") != prefix:
            return None
        total += int(rec["published"])
    return total


def _run_trainer(ctx: NodeContext, proc: Process) -> int:
    cfg = ctx.cfg
    from hpctoolkit.train.run import train

    # srun starts one process per rank; train() joins env:// when RANK/WORLD_SIZE are set.
    os.environ.update(trainer_env(ctx, proc))
    if cfg.training.data_source == "offline":
        if not cfg.data.offline_dir:
            raise ConfigError("training.data_source=offline needs data.offline_dir (the shard folder)")
        train(cfg, cfg.data.offline_dir, Path(cfg.paths.output_dir) / "train")
        return 0
    return _train_live(ctx, proc, train)


def _train_live(ctx: NodeContext, proc: Process, train: Any) -> int:
    import functools

    from hpctoolkit.capture.queue import write_drained
    from hpctoolkit.engine.engine import run_prefix
    from hpctoolkit.store.mooncake import MooncakeStore, count_keys_via_master
    from hpctoolkit.train.source import LiveSource, ManifestQueues

    t0 = time.monotonic()
    cfg = ctx.cfg
    out = Path(cfg.paths.output_dir)
    stale = sorted((out / "train" / "checkpoints").glob("step-*"))
    if stale:
        # Resuming would skip this job's samples (the store hands each out once, to this job).
        raise ConfigError(
            f"{out / 'train' / 'checkpoints'} holds checkpoints of an earlier run ({stale[-1].name}); "
            "a live run starts from the store, not from a checkpoint: give it a fresh paths.output_dir"
        )
    if proc.node_rank == 0:
        if cfg.data.offline_dir:
            say(
                f"WARNING: data.offline_dir has no effect on a live Slurm run; each rank spools to {out / 'spool'}"
            )
        if cfg.evaluate.enabled:
            say(
                "WARNING: evaluate.enabled has no effect on the slurm backend; evaluate the export separately"
            )
    rid = run_id(ctx)
    n = cfg.engine.num_engines
    prefixes = tuple(run_prefix(rid, i) for i in range(n))
    expected = tuple(engine_share(cfg.data.num_samples, n, i) for i in range(n))
    world = ctx.plan.trainer.world_size
    source = LiveSource(
        "",
        expected=sum(expected),
        store_factory=functools.partial(MooncakeStore, store_address(ctx), cfg.store, role="reader"),
        retry_max_wait_s=cfg.store.get_retry_max_wait_seconds,
        follow=ManifestQueues(str(out), prefixes, expected, QUEUE_STALL_TIMEOUT_S),
        spool_dir=str(out / "spool"),
    )
    rank0 = proc.node_rank == 0
    wait_reachable(store_address(ctx), DRY_REACH_TIMEOUT_S)
    metrics = _master_metrics_address(ctx, rid) if rank0 else None
    drained: dict[str, Any] = {}
    stop = threading.Event()

    def watch() -> None:
        # Rank 0 releases the engines as soon as every rank read its share, while training goes on.
        while not stop.wait(0.5):
            if _read_totals(source, world)[2]:
                try:
                    drained["keys_left_in_store"] = count_keys_via_master(metrics)
                finally:  # the engines go either way; a failed count is counted again below
                    write_drained(out, rid)
                drained["at_s"] = time.monotonic() - t0
                return

    watcher = threading.Thread(target=watch, name="hpctoolkit-drain-watch", daemon=True)
    if rank0:
        watcher.start()
    try:
        result = train(cfg, source, out / "train")
    finally:
        stop.set()
        if rank0 and "at_s" not in drained:
            # Training ended first (or failed): release the engines anyway; the summary says so.
            write_drained(out, rid)
    if not rank0:
        return 0
    watcher.join(timeout=30)
    deadline = time.monotonic() + READ_RECORDS_TIMEOUT_S
    read, moved, complete = _read_totals(source, world)
    while not complete and "at_s" not in drained and world > 1 and time.monotonic() < deadline:
        time.sleep(0.5)
        read, moved, complete = _read_totals(source, world)
    keys_left = drained.get("keys_left_in_store")
    if keys_left is None:
        keys_left = count_keys_via_master(metrics)
    published = _published(out, prefixes)
    summary = {
        "recipe": cfg.name,
        "run_id": rid,
        "samples_published": published,
        "samples_read": read,
        "bytes_moved": moved,
        "keys_left_in_store": keys_left,
        "steps_trained": result.get("steps_trained"),
        "final_loss": result.get("final_loss"),
        "export_dir": result.get("export_dir"),
        "drained_after_s": round(drained["at_s"], 1) if "at_s" in drained else None,
        "wall_seconds": round(time.monotonic() - t0, 1),
    }
    if published is None or read != published:
        # Not an error (training.steps may end before one pass), but never silent.
        summary["samples_unread"] = None if published is None else published - read
        say(f"WARNING: trained on {read} of {published} published samples; the rest were never read")
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    say(f"summary: {json.dumps(summary)}")
    return 0


_ROLE_FUNCS = {
    ROLE_MASTER: _run_master,
    ROLE_ENGINE_LEADER: _run_engine_leader,
    ROLE_ENGINE_FOLLOWER: _run_engine_follower,
    ROLE_TRAINER: _run_trainer,
}


def dry_roles(value: str | None) -> frozenset[str]:
    """Roles `HPCTOOLKIT_NODE_DRY` makes dry: "1" all, "0"/unset none, else a comma list."""
    value = (value or "0").strip()
    if value == "1":
        return frozenset(ROLES)
    if value in ("", "0"):
        return frozenset()
    roles = frozenset(r.strip() for r in value.split(",") if r.strip())
    unknown = sorted(roles - set(ROLES))
    if unknown:
        raise ConfigError(f"HPCTOOLKIT_NODE_DRY names unknown roles {unknown}; valid: {list(ROLES)}")
    return roles


def wait_reachable(address: str, timeout_s: float) -> float:
    """Seconds until a TCP connection to host:port succeeds; StoreError naming it after timeout_s."""
    host, _, port = address.rpartition(":")
    t0 = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return time.monotonic() - t0
        except OSError as err:
            if time.monotonic() - t0 > timeout_s:
                raise StoreError(
                    f"the Mooncake master at {address} is unreachable after {timeout_s:.0f}s: {err}"
                ) from err
            time.sleep(0.2)


def run_process(ctx: NodeContext, proc: Process, *, dry: bool | None = None) -> str | int:
    dry_set = dry_roles(envs.get(envs.HPCTOOLKIT_NODE_DRY.name)) if dry is None else None
    if dry is None:
        dry = proc.role in dry_set
    if dry:
        line = dry_line(ctx, proc)
        if (
            dry_set is not None
            and ROLE_MASTER not in dry_set
            and ctx.plan.master
            and proc.role != ROLE_MASTER
        ):
            # The master runs for real: prove this node reaches it at the planned address.
            address = store_address(ctx)
            waited = wait_reachable(address, DRY_REACH_TIMEOUT_S)
            line += f" store={address} reached_after_s={waited:.1f}"
        print(line, flush=True)
        return line
    return _ROLE_FUNCS[proc.role](ctx, proc)


def run_task(plan: Plan, recipe: str, overrides: Sequence[str], dry: bool) -> str | int | None:
    """submitit's entry: every task of the job runs this; SLURM_LOCALID picks the process.

    `plan` is the one computed at submission. Spare tasks (submitit gives every node the same task
    count) and dry runs decide from it alone, without loading the recipe; a real role loads the
    recipe and refuses to start if its plan differs.
    """
    senv = SlurmEnvironment.from_env()
    here = plan.on_node(senv.node_index)
    if senv.local_id >= len(here):
        return None
    proc = here[senv.local_id]
    if dry:
        ctx = NodeContext(None, plan, senv.node_index, senv.nodelist, senv.nodename or "?", senv)
        return run_process(ctx, proc, dry=True)
    os.environ[envs.HPCTOOLKIT_PLAN_DIGEST.name] = plan.digest()
    return run_process(load_context(recipe, overrides), proc, dry=False)


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] in ("-h", "--help"):
        raise ConfigError(
            f"usage: python -m hpctoolkit.node ROLE RECIPE [section.key=value ...]; ROLE is one of "
            f"{[ROLE_CHECK, *ROLES]}"
        )
    role, recipe, overrides = argv[0], argv[1], argv[2:]
    if role not in (ROLE_CHECK, *ROLES):
        raise ConfigError(f"unknown role {role!r}; valid roles: {[ROLE_CHECK, *ROLES]}")
    ctx = load_context(recipe, overrides)
    if role == ROLE_CHECK:
        print(f"plan {ctx.plan.digest()} matches; this is n{ctx.node} ({ctx.nodename})", flush=True)
        return 0
    result = run_process(ctx, select_process(ctx, role))
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
