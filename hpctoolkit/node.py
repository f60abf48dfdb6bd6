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
"""

from __future__ import annotations

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
from hpctoolkit.errors import ConfigError, StoreError
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
# A dry role waits at most this long for a real master (which imports torch and spawns the binary).
DRY_REACH_TIMEOUT_S = 90.0


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
    from hpctoolkit.config import load_recipe

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


def _wait_for_term() -> None:
    """Block a service role until the batch script ends it (SIGTERM) or the job is cancelled."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    done.wait()


def _run_master(ctx: NodeContext, proc: Process) -> int:
    from hpctoolkit.store.master import resolve_master

    m = ctx.plan.master
    if m is None:
        raise ConfigError(
            "store.master_address is set: this run connects to an external master, none runs here"
        )
    store_cfg = replace(ctx.cfg.store, bind_host=master_bind_host(ctx), master_port=m.port)
    log_dir = Path(ctx.cfg.paths.output_dir) / "logs"
    with resolve_master(store_cfg, log_dir) as master:
        print(f"mooncake master at {master.address} on {ctx.nodename}", flush=True)
        _wait_for_term()
    return 0


def _run_engine(ctx: NodeContext, proc: Process) -> int:
    # What exists: hpctoolkit.engine.engine.CaptureEngine (one node) and
    # hpctoolkit.engine.follower.HeadlessFollower (takes node_rank/nnodes/master_addr/master_port).
    # What is missing for a Slurm engine node:
    raise NotImplementedError(
        f"{proc.role} on Slurm: hpctoolkit.engine.engine.build_llm_kwargs refuses engine.nnodes>1 "
        "(no node_rank/master_addr plumbing into CaptureEngine), and no Slurm capture driver exists "
        "yet that picks engine e's prompt shard and publishes its manifests for the trainers "
        "(hpctoolkit.pipeline has only the local driver). Wiring: leader = CaptureEngine with "
        f"master_addr=host(n{proc.node}), master_port=plan.engines[e].master_port; follower = "
        "HeadlessFollower(build_llm_kwargs(...) minus NODE_KEYS, node_rank, nnodes, master_addr, master_port)"
    )


def _run_trainer(ctx: NodeContext, proc: Process) -> int:
    cfg = ctx.cfg
    if cfg.training.data_source != "offline":
        raise NotImplementedError(
            "trainer on Slurm with training.data_source=live: no live samples source exists yet for "
            "Slurm (a factory around hpctoolkit.data.dataset.HiddenStateDataset reading the manifests "
            "the engine leaders publish; see hpctoolkit.train.source). Use training.data_source=offline "
            "with data.offline_dir, or add that source."
        )
    if not cfg.data.offline_dir:
        raise ConfigError("training.data_source=offline needs data.offline_dir (the shard folder)")
    from hpctoolkit.train.run import train

    # srun starts one process per rank; train() joins env:// when RANK/WORLD_SIZE are set.
    os.environ.update(trainer_env(ctx, proc))
    train(cfg, cfg.data.offline_dir, Path(cfg.paths.output_dir) / "train")
    return 0


_ROLE_FUNCS = {
    ROLE_MASTER: _run_master,
    ROLE_ENGINE_LEADER: _run_engine,
    ROLE_ENGINE_FOLLOWER: _run_engine,
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
