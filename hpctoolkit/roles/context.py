"""Where this process runs: the plan, its node, the run directory, and the addresses it dials.

Which engine, node_rank or FSDP rank a process is comes from the plan and its environment
(`SLURMD_NODENAME` in the job's node list and `SLURM_PROCID` on Slurm; `RANK` from the local
launcher), never from hand-passed numbers, and a process that finds itself where the plan did not
put it stops with a `ConfigError`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpctoolkit import envs
from hpctoolkit.config.load import load_recipe
from hpctoolkit.config.schema import RecipeConfig
from hpctoolkit.errors import ConfigError, StoreError
from hpctoolkit.plan.placement import LOCALHOST, ROLE_TRAINER, Plan, Process, make_plan
from hpctoolkit.rundir.atomic import read_json
from hpctoolkit.rundir.layout import RunDir, slurm_run_id
from hpctoolkit.slurm.env import SlurmEnvironment

# The master's record of its addresses (it starts with the other roles and imports torch first).
MASTER_RECORD_TIMEOUT_S = 120.0


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
    # This process's trainer rank when the local launcher started it (Slurm: SLURM_PROCID).
    local_rank_env: int = 0

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
    env = os.environ if environ is None else environ
    cfg = load_recipe(recipe, list(overrides))
    plan = make_plan(cfg)
    check_digest(plan, recipe, env)
    if SlurmEnvironment.detected(env):
        senv = SlurmEnvironment.from_env(env)
        if len(senv.nodelist) != plan.num_nodes:
            raise ConfigError(
                f"the job has {len(senv.nodelist)} node(s) but the plan places {plan.num_nodes}"
            )
        run = RunDir.of(cfg.paths.output_dir, run_id_for(cfg.name, senv, env))
        return NodeContext(cfg, plan, senv.node_index, senv.nodelist, senv.nodename or "?", senv, run)
    if plan.backend != "local":
        raise ConfigError("the slurm backend's roles run inside a Slurm job (SLURM_JOB_ID is unset)")
    run = RunDir.of(cfg.paths.output_dir, run_id_for(cfg.name, None, env))
    rank = int(env.get("RANK", "0"))
    return NodeContext(cfg, plan, 0, (LOCALHOST,), LOCALHOST, None, run, rank)


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


def node_address(host: str) -> str:
    """`host` as an address (the same lookup on every node); the name itself if it does not resolve."""
    try:
        return socket.gethostbyname(host)
    except OSError:
        return host


def master_bind_host(ctx: NodeContext) -> str:
    """The address the master binds and everyone dials: the recipe's, or its node's host name
    resolved to an address (the same lookup on every node of the job)."""
    m = ctx.plan.master
    if m is None:
        raise ConfigError("store.master_address is set: this run connects to an external master")
    return m.bind_host or node_address(ctx.host(m.node))


def store_address(ctx: NodeContext) -> str:
    """host:port every engine and trainer uses to reach the Mooncake master."""
    plan = ctx.plan
    if plan.external_master:
        return plan.external_master
    if plan.master is None:  # pragma: no cover - make_plan always sets one of the two
        raise AssertionError("plan has neither a master nor an external master")
    if plan.master.port == 0:
        # The local backend picks the master's port at start: its record names it.
        return read_master_record(ctx)["address"]
    return f"{master_bind_host(ctx)}:{plan.master.port}"


def read_master_record(ctx: NodeContext, timeout_s: float = MASTER_RECORD_TIMEOUT_S) -> dict[str, Any]:
    """This run's master record (`roles.master` writes it once the master answers); a bounded wait."""
    path = ctx.run.master_record
    deadline = time.monotonic() + timeout_s
    while True:
        record = read_json(path)
        if isinstance(record, dict) and record.get("run_id") == ctx.run_id:
            return record
        if time.monotonic() > deadline:
            raise StoreError(
                f"the Mooncake master of run {ctx.run_id} did not write {path} within {timeout_s:.0f}s"
            )
        time.sleep(0.2)


def trainer_env(ctx: NodeContext, proc: Process) -> dict[str, str]:
    """torch.distributed's variables for one FSDP rank; pure."""
    t = ctx.plan.trainer
    return {
        "RANK": str(proc.node_rank),
        "LOCAL_RANK": str(proc.local_rank),
        "WORLD_SIZE": str(t.world_size),
        "LOCAL_WORLD_SIZE": str(t.ranks_per_node),
        "MASTER_ADDR": node_address(ctx.host(t.nodes[0])),
        "MASTER_PORT": str(t.master_port),
    }


def engine_node_args(ctx: NodeContext, proc: Process, cores: Any = None) -> dict[str, Any]:
    """This engine node's keywords for `engine_llm_kwargs` (and `CaptureEngine`) beyond the shared
    ones: its address, its cores, and for a multi-node engine its node_rank and the rendezvous."""
    if proc.engine is None:
        raise AssertionError(f"{proc} is not an engine process")
    e = ctx.plan.engines[proc.engine]
    args: dict[str, Any] = {"engine_index": e.index}
    if ctx.slurm is not None:
        # The node's own address and cores: vLLM and gloo bind the one, the workers split the other.
        args.update(host_ip=node_address(ctx.nodename), cores=cores)
    if e.nnodes > 1:
        args.update(
            node_rank=proc.node_rank,
            master_addr=node_address(ctx.host(e.leader.node)),
            master_port=e.master_port,
        )
    return args
