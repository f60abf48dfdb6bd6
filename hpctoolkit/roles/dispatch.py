"""Which role function a process runs, dry mode, and submitit's per-task entry.

`HPCTOOLKIT_NODE_DRY=1` replaces every role's work with one line
`role=<role> node=<SLURMD_NODENAME> engine=<i> node_rank=<r> gpus=<CUDA_VISIBLE_DEVICES> ...`
and exit 0: the real-Slurm tests use it to prove placement on machines without GPUs.

Under submitit (`run_task`) every task of the job calls the same function; the task's position
on its node (`SLURM_LOCALID`) picks one of the plan's processes on that node, or node 0's watcher
(`slurm.tasks.task_process`), and spare tasks return at once. Each task then follows its part of
`plan.lifecycle` (`follow`: `lifecycle.drive` through the task's hooks, `SubmititTask`): task 0
starts the attempt (the others wait for it; node 0's watcher then watches until the job ends), each
role's task is that role's phase, and trainer rank 0's task carries the rest: after a clean run it
waits for the drain (the engines' close records, within the one grace), then runs the evaluate role
in a fresh process when `evaluate.enabled` (as the batch script does). The master's task stops once
the run is over (the stop phase); submitit's handler on task 0 requeues a preempted job. A failing
task prints `run_cli`'s one line and still fails.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType

from hpctoolkit import envs
from hpctoolkit.cli import dump_stacks_on_sigusr1, report
from hpctoolkit.errors import StoreError
from hpctoolkit.plan import lifecycle
from hpctoolkit.plan.placement import (
    ROLE_ENGINE_FOLLOWER,
    ROLE_ENGINE_LEADER,
    ROLE_MASTER,
    ROLE_TRAINER,
    Plan,
    Process,
)
from hpctoolkit.roles.child import Child
from hpctoolkit.roles.context import NodeContext, load_context, note_host, pinned_of, store_address
from hpctoolkit.roles.dry import dry_roles
from hpctoolkit.roles.engines import run_engine_follower, run_engine_leader
from hpctoolkit.roles.evaluate import evaluate_in_fresh_process
from hpctoolkit.roles.heartbeat import Heartbeat, guard_process_group
from hpctoolkit.roles.master import run_master, run_watcher
from hpctoolkit.roles.trainer import run_trainer
from hpctoolkit.roles.waits import MASTER_REACH_TIMEOUT_S, wait_reachable
from hpctoolkit.roles.watch import PeerWatch, Probe
from hpctoolkit.rundir import alive
from hpctoolkit.rundir.atomic import read_json
from hpctoolkit.slurm.env import SlurmEnvironment
from hpctoolkit.slurm.tasks import WATCHER, task_process

ROLE_FUNCS: dict[str, Callable[[NodeContext, Process], int]] = {
    ROLE_MASTER: run_master,
    ROLE_ENGINE_LEADER: run_engine_leader,
    ROLE_ENGINE_FOLLOWER: run_engine_follower,
    ROLE_TRAINER: run_trainer,
}
# The lifecycle phase each role's task is (`plan.lifecycle.PHASES[...].starts`).
PHASE_OF_ROLE = {r: p.name for p in lifecycle.PHASES for r in p.starts}
# Told each phase a task enters (the scenario tests record them).
OnPhase = Callable[[str], None]


def dry_line(ctx: NodeContext, proc: Process, environ: Mapping[str, str] | None = None) -> str:
    return _dry_line(ctx.plan, ctx.nodename, proc, environ)


def _dry_line(plan: Plan, nodename: str, proc: Process, environ: Mapping[str, str] | None = None) -> str:
    """What a dry run prints for `proc`: read from the plan alone (no recipe is loaded)."""
    env = os.environ if environ is None else environ
    gpus = env.get("CUDA_VISIBLE_DEVICES") or "-"
    planned = ",".join(map(str, proc.gpus)) or "-"
    fields = [
        f"role={proc.role}",
        f"node={nodename}",
        f"engine={'-' if proc.engine is None else proc.engine}",
    ]
    if proc.role == ROLE_TRAINER:
        t = plan.trainer
        fields += [
            f"node_rank={t.nodes.index(proc.node)}",
            f"gpus={gpus}",
            f"rank={proc.node_rank}",
            f"local_rank={proc.local_rank}",
            f"planned_gpus={planned}",
        ]
    else:
        rank = "-" if proc.node_rank is None else proc.node_rank
        fields += [f"node_rank={rank}", f"gpus={gpus}", f"planned_gpus={planned}"]
    fields.append(f"index={proc.node}")
    return " ".join(fields)


def run_process(ctx: NodeContext, proc: Process, *, dry: bool | None = None) -> str | int:
    dry_set = dry_roles(envs.get(envs.HPCTOOLKIT_NODE_DRY.name)) if dry is None else None
    if dry is None:
        dry = proc.role in (dry_set or ())
    if not dry:
        note_host(ctx)
        # gloo and NCCL (trainers, vLLM's workers) use the data-plane interface too.
        ifname = ctx.host_address.ifname
        os.environ.update(GLOO_SOCKET_IFNAME=ifname, NCCL_SOCKET_IFNAME=ifname)
        # The role's record of itself: a peer tells its death from its leaving by it.
        beat = Heartbeat(ctx, proc).start()
        try:
            if ctx.slurm is None or ctx.plan.num_nodes == 1:
                code = ROLE_FUNCS[proc.role](ctx, proc)
            else:
                code = _watched(ctx, proc, beat)
        except BaseException:
            beat.leave("failed")
            raise
        beat.leave("ok")
        return code
    line = dry_line(ctx, proc)
    if dry_set is not None and ROLE_MASTER not in dry_set and ctx.plan.master and proc.role != ROLE_MASTER:
        # The master runs for real: prove this node reaches it at the planned address.
        address = store_address(ctx)
        waited = wait_reachable(address, MASTER_REACH_TIMEOUT_S)
        line += f" store={address} reached_after_s={waited:.1f}"
    print(line, flush=True)
    return line


def _watched(ctx: NodeContext, proc: Process, beat: Heartbeat) -> int:
    """Run the role while watching the job's other hosts and role processes; a lost host or a dead
    role is the error, whatever the role itself then saw (an interrupted wait, a failed put, a
    stopped capture). How the role left is recorded before its probe closes (`roles.watch`)."""
    probe = Probe(ctx, beat.key)
    watch = PeerWatch(ctx).start()
    try:
        code = ROLE_FUNCS[proc.role](ctx, proc)
    except BaseException as err:
        # A lost host is the cause of whatever the role then saw (a failed get, a stalled wait).
        watch.stop()
        lost = watch.lost or (watch.verdict() if isinstance(err, Exception) else None)
        # A dead peer found (the master, whose store this role's calls then failed on) is why this
        # role failed: its end record names it, so the run names that role, not this one.
        beat.leave(alive.FAILED, cause=watch.cause if lost else None)
        if lost:
            raise StoreError(lost) from err
        raise
    finally:
        watch.stop()
        # The first call counts: "failed" when the role raised, or when a loss came as it returned.
        beat.leave(alive.FAILED if watch.lost else "ok", cause=watch.cause if watch.lost else None)
        probe.close()
    if watch.lost:
        raise StoreError(watch.lost)
    return code


def run_task(plan: Plan, recipe: str, overrides: Sequence[str], dry: bool) -> str | int | None:
    """submitit's entry: every task of the job runs this; SLURM_LOCALID picks the process.
    Before any role starts, task 0 begins the attempt (`_begin_attempt`).

    `plan` is the one computed at submission. Spare tasks (submitit gives every node the same task
    count) and dry runs decide from it alone, without loading the recipe; a real role loads the
    recipe and refuses to start if its plan differs.

    A failure prints the one line `run_cli` would (`cli.report`) and is raised on, so the task
    fails and submitit keeps its traceback in the job's result (`job.result()` shows it); the
    task's log gets the line only.
    """
    dump_stacks_on_sigusr1()
    try:
        return _run_task(plan, recipe, overrides, dry)
    except Exception as err:
        report(err)
        _no_traceback_for(err)
        raise


def _no_traceback_for(err: BaseException) -> None:
    """submitit re-raises `err` out of the task's interpreter; its last-resort hook then stays
    silent for that one error (its line is printed already)."""
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if value is not err:
            previous(kind, value, tb)

    sys.excepthook = hook


def _run_task(plan: Plan, recipe: str, overrides: Sequence[str], dry: bool) -> str | int | None:
    senv = SlurmEnvironment.from_env()
    proc = task_process(plan, senv.node_index, senv.local_id)
    if proc is None or (dry and proc == WATCHER):
        return None
    if dry:
        assert isinstance(proc, Process)
        line = _dry_line(plan, senv.nodename or "?", proc)
        print(line, flush=True)
        return line
    os.environ[envs.HPCTOOLKIT_PLAN_DIGEST.name] = plan.digest()
    ctx = load_context(recipe, overrides)
    guard_process_group()  # what the task starts ends with it, even when it is killed outright
    return follow(ctx, senv, proc, recipe, overrides)


def follow(
    ctx: NodeContext,
    senv: SlurmEnvironment,
    proc: Process | str,
    recipe: str,
    overrides: Sequence[str],
    on_phase: OnPhase | None = None,
) -> int | str:
    """This task's part of `plan.lifecycle`, walked by `lifecycle.drive` through its hooks
    (`SubmititTask`): the start (task 0 begins the attempt; the others wait for it), its role's
    phase, and for trainer rank 0 the drain and evaluate after it. Returns the task's status: the
    role's, or evaluate's when it ran."""
    enter = on_phase or (lambda _name: None)
    task = SubmititTask(ctx, senv, proc, recipe, overrides)
    shape = lifecycle.RunShape.of(ctx.plan, ctx.cfg.evaluate.enabled)
    lifecycle.drive("submitit", task.hooks(), shape, lambda phase: enter(phase.name))
    return task.result


class SubmititTask:
    """One submitit task's hooks: a hook in its role's phase (the master's and the watcher's task
    also in the stop, trainer rank 0's in the drain and evaluate), None in the others."""

    def __init__(
        self,
        ctx: NodeContext,
        senv: SlurmEnvironment,
        proc: Process | str,
        recipe: str,
        overrides: Sequence[str],
    ):
        self.ctx, self.senv, self.proc = ctx, senv, proc
        self.recipe, self.overrides = recipe, list(overrides)
        self.result: int | str = 0
        self.environ: dict[str, str] = {}

    def hooks(self) -> lifecycle.Hooks:
        proc = self.proc
        own = PHASE_OF_ROLE[proc.role] if isinstance(proc, Process) else None
        rank0 = isinstance(proc, Process) and proc.role == ROLE_TRAINER and proc.node_rank == 0
        # The master's role returns once the run is over (every engine closed, the trainers ended),
        # the watcher's (from the start on) with the job: each stops then.
        stops = own == "master" or proc == WATCHER
        return {
            "start": self.start,
            "master": self.role if own == "master" else None,
            "engines": self.role if own == "engines" else None,
            "trainers": self.role if own == "trainers" else None,
            "drain": self.drain if rank0 else None,
            "evaluate": self.evaluate if rank0 else None,
            "stop": self.stop if stops else None,
            # The end: the trainers' end records; submitit's handler on task 0 requeues a preempted job.
            "end": None,
        }

    def start(self, _seen: lifecycle.Seen) -> None:
        _begin_attempt(self.ctx, self.senv)
        if self.proc == WATCHER:
            self.result = run_watcher(self.ctx)

    def role(self, _seen: lifecycle.Seen) -> lifecycle.Seen | None:
        assert isinstance(self.proc, Process)
        self.environ = dict(os.environ)  # before the role adds its own (torch.distributed's, the interfaces)
        self.result = result = run_process(self.ctx, self.proc, dry=False)
        if self.proc.role != ROLE_TRAINER or self.proc.node_rank != 0 or not isinstance(result, int):
            return None
        from hpctoolkit.train import preempt

        return lifecycle.Seen(trainers_rc=result, late=preempt.requested())

    def drain(self, seen: lifecycle.Seen) -> None:
        # The engines drain by themselves here; this task waits for them only when evaluate follows.
        shape = lifecycle.RunShape.of(self.ctx.plan, self.ctx.cfg.evaluate.enabled)
        if lifecycle.enters("evaluate", shape, seen):
            _wait_drained(self.ctx, lifecycle.bound_s("drain", seen) or 0)

    def evaluate(self, _seen: lifecycle.Seen) -> None:
        # vLLM gets a process of its own (`roles.child`).
        args = (self.recipe, self.overrides, self.environ)
        child = Child("evaluate", evaluate_in_fresh_process, args, self.ctx.run.logs)
        self.result = int(child.result())

    def stop(self, _seen: lifecycle.Seen) -> None:
        pass  # the role returned: nothing of this task's is left to end


def _wait_drained(ctx: NodeContext, bound_s: float) -> None:
    """Until every engine's close record is there (it left its store segment), at most `bound_s`:
    the engines leave by themselves here, nobody ends them before the job does."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if all(read_json(ctx.run.engine_closed(e.index)) is not None for e in ctx.plan.engines):
            return
        time.sleep(0.5)


def _begin_attempt(ctx: NodeContext, senv: SlurmEnvironment) -> None:
    """The lifecycle's start phase, once per attempt (the batch script's check step): task 0
    starts it (`ledger.start_attempt`); the others wait for it."""
    from hpctoolkit.recipe.load import to_yaml
    from hpctoolkit.rundir import inputs_record, ledger

    restart = ledger.restart_count()
    if senv.proc_id == 0:
        ledger.start_attempt(ctx.run, to_yaml(ctx.cfg), pinned_of(ctx), senv.job_id, restart=restart)
    else:
        ledger.wait_attempt(ctx.run, senv.job_id, restart)
        # At the first attempt this task may have loaded its context before task 0 pinned the inputs.
        inputs_record.check(ctx.run, pinned_of(ctx))
