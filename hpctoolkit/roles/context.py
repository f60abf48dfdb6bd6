"""Where this process runs: the plan, its node, the run directory, and the addresses it dials.

Which engine, node_rank or FSDP rank a process is comes from the plan and its environment
(`SLURMD_NODENAME` in the job's node list and `SLURM_PROCID` on Slurm; `RANK` from the local
launcher), never from hand-passed numbers, and a process that finds itself where the plan did not
put it stops with a `ConfigError`.

Ports are per run (`plan.ports`): the node that hosts a listener picks the port when the
listener starts (`roles.network.listen` / `free_port`) and records it, with the data-plane
address it binds, in `ports/<listener>.json` (`publish_port`):
`{"run_id", "listener", "node", "nodename", "address", "port"}`. The processes on other nodes wait
for that record, bounded (`endpoint_of`). It is written before the listener is up, so a peer may
still wait for the port to open (vLLM and torch retry their connects). `python -m hpctoolkit.status`
shows them; a new attempt of a Slurm job removes an earlier attempt's (`rundir.ledger`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctoolkit import envs
from hpctoolkit.engine.kwargs import NodeArgs
from hpctoolkit.errors import ConfigError, StoreError
from hpctoolkit.plan.lifecycle import MASTER_START_TIMEOUT_S
from hpctoolkit.plan.placement import LOCALHOST, ROLE_TRAINER, Plan, Process, make_plan
from hpctoolkit.plan.ports import TRAINER_LISTENER, engine_listener
from hpctoolkit.recipe.load import load_pinned
from hpctoolkit.recipe.schema import RecipeConfig
from hpctoolkit.roles.measure_inputs import measure as measure_inputs
from hpctoolkit.roles.network import LOOPBACK, HostAddress, free_port, listen, local_address
from hpctoolkit.rundir import inputs_record
from hpctoolkit.rundir.atomic import read_json, write_json_atomic
from hpctoolkit.rundir.layout import RunDir, slurm_run_id
from hpctoolkit.slurm.env import SlurmEnvironment
from hpctoolkit.store.config import StoreConfig

# The master's record of its addresses: the lifecycle's one start-up bound (it starts with the
# other roles and imports torch first).
MASTER_RECORD_TIMEOUT_S = MASTER_START_TIMEOUT_S
LOOPBACK_ADDRESS = HostAddress(LOOPBACK, "127.0.0.1")
# Another node's address record (its roles start with this one).
HOST_RECORD_TIMEOUT_S = 120.0
# A listener's port record: its node's role starts with this one, but writes the record only once
# its own start-up (a master to reach, prompts to load, for an engine's capture rendezvous the
# generating engine to finish) is done.
PORT_RECORD_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class NodeContext:
    """Where this process runs: the plan, its node index, the hosts of the allocation, its run."""

    cfg: RecipeConfig
    plan: Plan
    node: int
    hosts: tuple[str, ...]
    nodename: str
    slurm: SlurmEnvironment | None
    run: RunDir
    # This host's interface and address on the data-plane network (`cluster.network`).
    host_address: HostAddress = LOOPBACK_ADDRESS
    # This process's trainer rank when the local launcher started it (Slurm: SLURM_PROCID).
    local_rank_env: int = 0
    # The resolved recipe and its inputs as this process found them (`rundir.inputs_record`); None only
    # for a context made by hand, from which no attempt starts (`pinned_of`).
    pinned: inputs_record.Pin | None = None

    def host(self, node: int) -> str:
        return self.hosts[node]

    @property
    def run_id(self) -> str:
        """Unique per run and the same on every node of it: prefixes sample keys and records."""
        return self.run.run_id

    @property
    def trainer_rank(self) -> int:
        return self.slurm.proc_id if self.slurm else self.local_rank_env


def run_id_for(name: str, slurm: SlurmEnvironment | None, env: Mapping[str, str]) -> str:
    rid = env.get(envs.HPCTOOLKIT_RUN_ID.name)
    if rid:
        return rid
    if slurm is not None:
        return slurm_run_id(name, slurm.job_id)
    raise ConfigError(
        f"{envs.HPCTOOLKIT_RUN_ID.name} is unset: a role outside Slurm is started by "
        "`python -m hpctoolkit.submit RECIPE`, which names the run"
    )


def check_digest(plan: Plan, recipe: str, env: Mapping[str, str]) -> None:
    want = env.get(envs.HPCTOOLKIT_PLAN_DIGEST.name)
    if want and want != plan.digest():
        raise ConfigError(
            f"the batch script was rendered for placement {want}, but {recipe} with these overrides "
            f"plans {plan.digest()}; re-render it (python -m hpctoolkit.submit {recipe} --render-sbatch)"
        )


def load_context(
    recipe: str, overrides: Sequence[str], environ: Mapping[str, str] | None = None
) -> NodeContext:
    """This process's place in the run of `recipe` with `overrides`: the plan (checked against the
    batch script's digest), its node and run directory, and its inputs, checked against those the
    run pinned at its start (`rundir.inputs_record`; a change is a `ConfigError`)."""
    env = os.environ if environ is None else environ
    cfg, recipe_yaml = load_pinned(recipe, list(overrides))
    plan = make_plan(cfg)
    check_digest(plan, recipe, env)
    ctx = _place(cfg, plan, env)
    # Every role on every node: the inputs it reads are those the run started with.
    pinned = measure_inputs(cfg, recipe_yaml)
    inputs_record.check(ctx.run, pinned)
    return dataclasses.replace(ctx, pinned=pinned)


def _place(cfg: RecipeConfig, plan: Plan, env: Mapping[str, str]) -> NodeContext:
    if SlurmEnvironment.detected(env):
        senv = SlurmEnvironment.from_env(env)
        if len(senv.nodelist) != plan.num_nodes:
            raise ConfigError(
                f"the job has {len(senv.nodelist)} node(s) but the plan places {plan.num_nodes}"
            )
        run = RunDir.of(cfg.paths.output_dir, run_id_for(cfg.name, senv, env))
        name = senv.nodename or "?"
        here = local_address(cfg.cluster.network or LOOPBACK, name)
        if plan.num_nodes > 1 and here.loopback and cfg.cluster.network != LOOPBACK:
            raise ConfigError(
                f"cluster.network={cfg.cluster.network!r} gives host {name} the loopback address "
                f"{here.address}, which other hosts cannot reach"
            )
        return NodeContext(cfg, plan, senv.node_index, senv.nodelist, name, senv, run, here)
    if plan.backend != "local":
        raise ConfigError("the slurm backend's roles run inside a Slurm job (SLURM_JOB_ID is unset)")
    run = RunDir.of(cfg.paths.output_dir, run_id_for(cfg.name, None, env))
    rank = int(env.get("RANK", "0"))
    here = local_address(cfg.cluster.network or LOOPBACK, LOCALHOST)
    return NodeContext(cfg, plan, 0, (LOCALHOST,), LOCALHOST, None, run, here, rank)


def pinned_of(ctx: NodeContext) -> inputs_record.Pin:
    """The inputs `load_context` measured; an attempt never starts from a context without them."""
    if ctx.pinned is None:
        raise AssertionError("a run's attempt starts from load_context, which measures its inputs")
    return ctx.pinned


def select_process(ctx: NodeContext, role: str) -> Process:
    """The plan's process for `role` on this node (for trainers: this process's rank)."""
    here = [p for p in ctx.plan.on_node(ctx.node) if p.role == role]
    if role == ROLE_TRAINER:
        here = [p for p in here if p.node_rank == ctx.trainer_rank]
    if not here:
        raise ConfigError(
            f"the plan puts no {role} on node n{ctx.node} ({ctx.nodename})"
            + (f" for rank {ctx.trainer_rank}" if role == ROLE_TRAINER else "")
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


def note_host(ctx: NodeContext) -> None:
    """Record this node's data-plane address in the run directory, for the roles on other nodes."""
    record = {
        "node": ctx.node,
        "nodename": ctx.nodename,
        "address": ctx.host_address.address,
        "ifname": ctx.host_address.ifname,
    }
    if read_json(ctx.run.host(ctx.node)) != record:
        write_json_atomic(ctx.run.host(ctx.node), record)


def _wait_record(
    path: Path, accept: Callable[[dict[str, Any]], bool], timeout_s: float, missing: str
) -> dict[str, Any]:
    """The JSON record at `path` once another role wrote one `accept` takes; StoreError(`missing`)
    after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        record = read_json(path)
        if isinstance(record, dict) and accept(record):
            return record
        if time.monotonic() > deadline:
            raise StoreError(missing)
        time.sleep(0.2)


def address_of(ctx: NodeContext, node: int, timeout_s: float = HOST_RECORD_TIMEOUT_S) -> str:
    """Node `node`'s data-plane address, as the roles on that node recorded it (a bounded wait)."""
    if node == ctx.node or ctx.slurm is None:
        return ctx.host_address.address
    path = ctx.run.host(node)
    record = _wait_record(
        path,
        lambda r: bool(r.get("address")),
        timeout_s,
        f"no role on node n{node} ({ctx.host(node)}) recorded its address in {path} within "
        f"{timeout_s:.0f}s; is its step running?",
    )
    return str(record["address"])


def master_bind_host(ctx: NodeContext) -> str:
    """The address the master binds: the recipe's `store.bind_host` on the local backend, else its
    node's data-plane address."""
    m = ctx.plan.master
    if m is None:
        raise ConfigError("store.master_address is set: this run connects to an external master")
    return m.bind_host or ctx.host_address.address


def store_address(ctx: NodeContext) -> str:
    """host:port every engine and trainer uses to reach the Mooncake master: the given one, or what
    this run's master recorded once it answered (the address it bound, the port it got)."""
    plan = ctx.plan
    if plan.external_master:
        return plan.external_master
    if plan.master is None:  # pragma: no cover - make_plan always sets one of the two
        raise AssertionError("plan has neither a master nor an external master")
    return str(read_master_record(ctx)["address"])


def client_store_config(ctx: NodeContext) -> StoreConfig:
    """The store section for this node's Mooncake clients: they bind and advertise its address."""
    return dataclasses.replace(ctx.cfg.store, bind_host=ctx.host_address.address)


def read_master_record(ctx: NodeContext, timeout_s: float = MASTER_RECORD_TIMEOUT_S) -> dict[str, Any]:
    """This run's master record (`roles.master` writes it once the master answers); a bounded wait."""
    path = ctx.run.master_record
    return _wait_record(
        path,
        lambda r: r.get("run_id") == ctx.run_id,
        timeout_s,
        f"the Mooncake master of run {ctx.run_id} did not write {path} within {timeout_s:.0f}s",
    )


@dataclass(frozen=True)
class Endpoint:
    """Where a listener of this run listens: its node's data-plane address and its picked port."""

    address: str
    port: int


def publish_port(ctx: NodeContext, listener: str, port: int) -> Endpoint:
    """Record that `listener` (`plan.ports`) listens on this node's data-plane address at `port`."""
    here = Endpoint(ctx.host_address.address, port)
    record = {"run_id": ctx.run_id, "listener": listener, "node": ctx.node, "nodename": ctx.nodename}
    write_json_atomic(ctx.run.port_record(listener), {**record, "address": here.address, "port": port})
    return here


def endpoint_of(
    ctx: NodeContext, listener: str, node: int, timeout_s: float = PORT_RECORD_TIMEOUT_S
) -> Endpoint:
    """Where `listener` on node `node` listens, once that node recorded it (a bounded wait)."""
    path = ctx.run.port_record(listener)
    record = _wait_record(
        path,
        lambda r: r.get("run_id") == ctx.run_id and bool(r.get("port")),
        timeout_s,
        f"node n{node} ({ctx.host(node)}) did not record the port of {listener} in {path} within "
        f"{timeout_s:.0f}s; did its role fail to start?",
    )
    return Endpoint(str(record["address"]), int(record["port"]))


def trainer_rendezvous(ctx: NodeContext, proc: Process) -> tuple[Endpoint | None, socket.socket | None]:
    """The trainers' torch.distributed rendezvous (None for one rank), and on rank 0 the socket its
    store serves on: rank 0 listens on its node's data-plane address and records the port; the
    other ranks wait for the record."""
    t = ctx.plan.trainer
    if t.world_size == 1:
        return None, None
    if proc.node_rank == 0:
        sock = listen(ctx.host_address.address)
        return publish_port(ctx, TRAINER_LISTENER, int(sock.getsockname()[1])), sock
    return endpoint_of(ctx, TRAINER_LISTENER, t.nodes[0]), None


def trainer_env(ctx: NodeContext, proc: Process, rendezvous: Endpoint | None) -> dict[str, str]:
    """torch.distributed's variables for one FSDP rank (`trainer_rendezvous`); pure."""
    t = ctx.plan.trainer
    env = {
        "RANK": str(proc.node_rank),
        "LOCAL_RANK": str(proc.local_rank),
        "WORLD_SIZE": str(t.world_size),
        "LOCAL_WORLD_SIZE": str(t.ranks_per_node),
    }
    if rendezvous is not None:
        env.update(MASTER_ADDR=rendezvous.address, MASTER_PORT=str(rendezvous.port))
    return env


def engine_node_args(
    ctx: NodeContext, proc: Process, cores: Sequence[int] | None = None, *, generating: bool = False
) -> NodeArgs:
    """This engine node's part of `engine_llm_kwargs` (and `CaptureEngine`): its address and its
    cores on Slurm, and for a multi-node engine its node_rank and the rendezvous (of its generating
    engine with `generating`): the leader picks a free port on its data-plane address and records
    it (vLLM binds it itself), the followers wait for the record. Call it right before the engine
    starts: the leader's pick is free only a moment (`roles.network.free_port`)."""
    if proc.engine is None or proc.node_rank is None:
        raise AssertionError(f"{proc} is not an engine process")
    e = ctx.plan.engines[proc.engine]
    node = NodeArgs()
    if ctx.slurm is not None:
        # The node's own address and cores: vLLM and gloo bind the one, the workers split the other.
        node = dataclasses.replace(
            node, host_ip=ctx.host_address.address, cores=None if cores is None else tuple(cores)
        )
    if e.nnodes > 1:
        listener = engine_listener(e.index, generating)
        if proc.node_rank == 0:
            where = publish_port(ctx, listener, free_port(ctx.host_address.address))
        else:
            where = endpoint_of(ctx, listener, e.leader.node)
        node = dataclasses.replace(
            node, node_rank=proc.node_rank, master_addr=where.address, master_port=where.port
        )
    return node
