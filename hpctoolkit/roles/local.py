"""The embedded run (`cluster.backend: local`, `make run`): the plan's roles as processes on this
machine, through the same role code and run directory as a Slurm job, phase by phase as
`plan.lifecycle` describes them (`lifecycle.drive` walks them; `Embedded` is this launcher's hooks):

    start -> master -> engines -> trainers -> drain -> evaluate -> stop -> end

Each role is `python -m hpctoolkit.roles ROLE RECIPE OVERRIDES...` with this run's id and plan
digest in its environment; its output goes to `<run>/logs/<name>.log`, and its `[hpctoolkit...]`
progress lines also to the console. A role that fails writes how (`<run>/logs/<name>.failure.json`,
`cli.run_cli`); the first role to fail stops the run: the others are ended and the failure comes
back as one line naming the role, its error and its log. SIGUSR2 (the time limit is near) goes to
the trainers, which checkpoint; a local run is not requeued, so that ends it with a failure line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from hpctoolkit import envs, errors
from hpctoolkit.errors import RoleFailedError
from hpctoolkit.output import console
from hpctoolkit.output.console import speaker
from hpctoolkit.plan import lifecycle
from hpctoolkit.plan.placement import ROLE_ENGINE_FOLLOWER, ROLE_ENGINE_LEADER, ROLE_TRAINER, Plan
from hpctoolkit.recipe.load import load_pinned, to_yaml
from hpctoolkit.recipe.schema import RecipeConfig
from hpctoolkit.roles.measure_inputs import measure as measure_inputs
from hpctoolkit.roles.results import trainer_acceptance_line
from hpctoolkit.rundir import ledger
from hpctoolkit.rundir.atomic import read_json
from hpctoolkit.rundir.layout import RunDir, local_run_id
from hpctoolkit.rundir.summary import merge_summary

# What a role process runs: `role_argv(role)`; the tests put stubs in.
RoleArgv = Callable[[str], list[str]]
# Told each phase the run enters, in order (`plan.lifecycle.PHASE_NAMES`).
OnPhase = Callable[[str], None]


say = speaker()


class RoleProcess:
    """One role process; its output is copied to its log, progress lines also to the console."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path, record: Path):
        self.name, self.log, self.record = name, log, record
        # Its status was taken (a trainer, evaluate) or it was ended: no longer the run's failure.
        self.settled = False
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[str] = log.open("a")
        env = {**env, envs.HPCTOOLKIT_FAILURE_RECORD.name: str(record)}
        self.proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self._pump = threading.Thread(target=self._copy, name=f"hpctoolkit-log-{name}", daemon=True)
        self._pump.start()

    def _copy(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith("[hpctoolkit"):
                console.echo(self.name, line)

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def failure(self) -> Exception:
        """The error this role reported (its failure record), as the same class where it is ours."""
        self._pump.join(timeout=5)
        where = f"(exit code {self.proc.returncode}; log {self.log})"
        rec = read_json(self.record)
        code = self.proc.returncode
        if (not isinstance(rec, dict) or not rec.get("said")) and code is not None and code < 0:
            # Killed outright (SIGKILL, the OOM killer): it said nothing; its status says how.
            return RoleFailedError(f"{self.name} died ({lifecycle.how_ended(code)}; log {self.log})")
        if not isinstance(rec, dict) or not rec.get("said"):
            lines = [x.strip() for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
            return RoleFailedError(f"{self.name} failed: {lines[-1] if lines else 'no output'} {where}")
        cls = getattr(errors, str(rec.get("error")), None)
        if isinstance(cls, type) and issubclass(cls, Exception) and rec.get("message"):
            return cls(f"{self.name}: {rec['message']} {where}")
        return RoleFailedError(f"{self.name} failed: {rec['said']} {where}")

    def stop(self, grace_s: float = lifecycle.STOP_GRACE_S) -> None:
        """SIGTERM to the role's process group, SIGKILL after a grace period."""
        self.settled = True
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._pump.join(timeout=5)
        self._log.close()


class RoleGroup:
    """Every role process of one run; its waits watch them all, so any failure stops the run."""

    def __init__(
        self,
        run: RunDir,
        recipe: str,
        overrides: Sequence[str],
        plan: Plan,
        role_argv: RoleArgv | None = None,
    ):
        self.run = run
        self.role_argv = role_argv or (
            lambda role: [sys.executable, "-m", "hpctoolkit.roles", role, recipe, *overrides]
        )
        self.env = dict(os.environ)
        self.env[envs.HPCTOOLKIT_RUN_ID.name] = run.run_id
        self.env[envs.HPCTOOLKIT_PLAN_DIGEST.name] = plan.digest()
        self.procs: list[RoleProcess] = []
        # SIGUSR2 came: the time limit is near (`on_usr2`).
        self.late = False

    def start(self, name: str, role: str, **extra_env: str) -> RoleProcess:
        env = {**self.env, **extra_env}
        p = RoleProcess(name, self.role_argv(role), env, self.run.log(name), self.run.failure(name))
        self.procs.append(p)
        return p

    def named(self, prefix: str) -> list[RoleProcess]:
        return [p for p in self.procs if p.name.startswith(prefix)]

    def check(self) -> None:
        """Any role failing (other than those whose status the run took) stops the run."""
        for p in self.procs:
            if not p.settled and p.poll() not in (None, 0):
                raise p.failure()

    def on_usr2(self, _signum: int, _frame: Any) -> None:
        self.late = True
        say("SIGUSR2: asking the trainers to checkpoint")
        for p in self.named("trainer"):
            p.signal(signal.SIGUSR2)

    def wait_trainers(self) -> tuple[int, RoleProcess | None]:
        """The trainers' status: 0 once all exited 0; the first other status, with its process, once
        one failed or all ended (PREEMPTED_EXIT: every rank checkpoints on SIGUSR2 first)."""
        trainers = self.named("trainer")
        for p in trainers:
            p.settled = True
        while True:
            self.check()
            codes = [p.poll() for p in trainers]
            done = [(c, p) for c, p in zip(codes, trainers, strict=True) if c is not None and c != 0]
            failed = [(c, p) for c, p in done if c != ledger.PREEMPTED_EXIT]
            if failed:
                return failed[0]
            if all(c is not None for c in codes):
                return done[0] if done else (0, None)
            time.sleep(lifecycle.EMBEDDED_POLL_S)

    def wait_gone(self, procs: Sequence[RoleProcess], timeout_s: float) -> bool:
        """Until every process of `procs` exited (one failing raises its error); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while not all(p.poll() is not None for p in procs):
            self.check()
            if time.monotonic() > deadline:
                return False
            time.sleep(lifecycle.EMBEDDED_POLL_S)
        self.check()
        return True

    def wait_for(self, predicate: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            self.check()
            if time.monotonic() > deadline:
                raise RoleFailedError(f"{what} within {timeout_s:.0f}s; logs under {self.run.logs}")
            time.sleep(lifecycle.EMBEDDED_POLL_S)

    def stop_all(self) -> None:
        # Consumers first, then producers, the master last: nobody waits on a peer already gone.
        for p in reversed(self.procs):
            p.stop()


def start_run(cfg: RecipeConfig, recipe: str, overrides: Sequence[str]) -> RunDir:
    """A new run directory with this run's resolved recipe and its inputs pinned (each role checks
    them when it starts); never one an earlier run used."""
    run = RunDir.of(cfg.paths.output_dir, local_run_id(cfg.name))
    _, recipe_yaml = load_pinned(recipe, overrides)
    ledger.start_attempt(run, to_yaml(cfg), measure_inputs(cfg, recipe_yaml), None, fresh=True)
    return run


def preflight(cfg: RecipeConfig, plan: Plan) -> None:
    """What can fail before a run directory exists: a given master that does not answer."""
    if plan.master is None:
        from hpctoolkit.store.probe import check_reachable

        check_reachable(plan.external_master or "", cfg.store.connect_timeout_s)


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_local(
    cfg: RecipeConfig,
    plan: Plan,
    recipe: str,
    overrides: Sequence[str],
    *,
    role_argv: RoleArgv | None = None,
    on_phase: OnPhase | None = None,
) -> dict[str, Any]:
    """Run the whole job on this machine: `plan.lifecycle.drive` walks the phases through this
    launcher's hooks (`Embedded`); returns the summary (also `<run>/summary.json`). A failed role,
    or trainers that checkpointed on SIGUSR2, raise."""
    preflight(cfg, plan)
    run = Embedded(cfg, plan, recipe, overrides, role_argv)
    shape = lifecycle.RunShape.of(plan, cfg.evaluate.enabled)
    enter = on_phase or (lambda _name: None)
    try:
        lifecycle.drive("embedded", run.hooks(), shape, lambda phase: enter(phase.name))
    finally:
        run.close()
    return run.summary


class Embedded:
    """The embedded launcher's hooks: each phase's roles as processes on this machine, watched by
    one `RoleGroup` (any failure raises out of the walk; `close` then ends every role)."""

    def __init__(
        self, cfg: RecipeConfig, plan: Plan, recipe: str, overrides: Sequence[str], role_argv: RoleArgv | None
    ):
        self.cfg, self.plan, self.recipe, self.overrides = cfg, plan, recipe, list(overrides)
        self.role_argv = role_argv
        self._group: RoleGroup | None = None
        self._restore: list[tuple[int, Any]] = []
        self.t0 = time.monotonic()
        # The failed trainer, the evaluate process: the end names them.
        self.failed: RoleProcess | None = None
        self.evaluate: RoleProcess | None = None
        self.summary: dict[str, Any] = {}

    def hooks(self) -> lifecycle.Hooks:
        return {
            "start": self.start,
            "master": self.master,
            "engines": self.engines,
            "trainers": self.trainers,
            "drain": self.drain,
            "evaluate": self.run_evaluate,
            "stop": self.stop,
            "end": self.end,
        }

    @property
    def group(self) -> RoleGroup:
        assert self._group is not None, "the start phase makes the run's group"
        return self._group

    def start(self, _seen: lifecycle.Seen) -> None:
        run = start_run(self.cfg, self.recipe, self.overrides)
        self.t0 = time.monotonic()
        self._group = RoleGroup(run, self.recipe, self.overrides, self.plan, self.role_argv)
        # Ended from outside (Ctrl-C, a batch system's SIGTERM): end the roles too.
        self._restore = [
            (signal.SIGTERM, signal.signal(signal.SIGTERM, _interrupt)),
            (signal.SIGUSR2, signal.signal(signal.SIGUSR2, self.group.on_usr2)),
        ]
        if self.plan.master is None:
            say(f"run {run.run_id} in {run.root}; Mooncake master {self.plan.external_master} (external)")

    def master(self, _seen: lifecycle.Seen) -> None:
        run, group = self.group.run, self.group
        say(f"run {run.run_id} in {run.root}")
        group.start("master", "master")
        group.wait_for(
            lambda: read_json(run.master_record) is not None,
            lifecycle.MASTER_START_TIMEOUT_S,
            "the Mooncake master did not start",
        )
        master = read_json(run.master_record)
        if master is None:
            raise RoleFailedError(
                f"the Mooncake master's record {run.master_record} vanished after it started"
            )
        say(f"Mooncake master at {master['address']}")

    def engines(self, _seen: lifecycle.Seen) -> None:
        for e in self.plan.engines:
            for node in e.nodes:
                role = ROLE_ENGINE_LEADER if node.node_rank == 0 else ROLE_ENGINE_FOLLOWER
                suffix = "" if node.node_rank == 0 else f".{node.node_rank}"
                self.group.start(f"engine{e.index}{suffix}", role)

    def trainers(self, _seen: lifecycle.Seen) -> lifecycle.Seen:
        group, plan = self.group, self.plan
        for r in plan.trainer.ranks:
            group.start(f"trainer{r.rank}", ROLE_TRAINER, RANK=str(r.rank))
        say(
            f"started {len(plan.engines)} engine(s) and {plan.trainer.world_size} trainer rank(s); "
            f"logs in {group.run.logs}"
        )
        rc, self.failed = group.wait_trainers()
        checkpointed = (
            rc not in (0, ledger.PREEMPTED_EXIT) and ledger.preempted_attempt(group.run) is not None
        )
        return lifecycle.Seen(trainers_rc=rc, late=group.late, checkpointed=checkpointed)

    def drain(self, seen: lifecycle.Seen) -> None:
        engines = self.group.named("engine")
        grace = lifecycle.bound_s("drain", seen) or 0
        if grace and not self.group.wait_gone(engines, grace):
            say(f"the engines did not leave within {grace}s of the trainers' end; ending them")
        for p in engines:
            p.stop()

    def run_evaluate(self, _seen: lifecycle.Seen) -> None:
        self.evaluate = evaluate = self.group.start("evaluate", "evaluate")
        evaluate.settled = True
        while evaluate.poll() is None:
            self.group.check()
            time.sleep(lifecycle.EMBEDDED_POLL_S)

    def stop(self, _seen: lifecycle.Seen) -> None:
        self.close()

    def close(self) -> None:
        """Every role ended, the signals given back (a failed walk's too)."""
        if self._group is not None:
            self._group.stop_all()
        for signum, previous in self._restore:
            signal.signal(signum, previous)
        self._restore = []

    def end(self, seen: lifecycle.Seen) -> None:
        run = self.group.run
        erc = None if self.evaluate is None else self.evaluate.poll()
        out = lifecycle.outcome(seen, erc)
        if out.kind == lifecycle.PREEMPTED:
            raise RoleFailedError(
                f"the trainers checkpointed on SIGUSR2 (exit {seen.trainers_rc}); a local run is not "
                f"requeued; its checkpoint is under {run.checkpoints}"
            )
        if out.failed == "trainers" and self.failed is not None:
            raise self.failed.failure()
        if out.failed == "evaluate" and self.evaluate is not None:
            raise self.evaluate.failure()
        self.summary = _summarize(run, self.t0)


def _summarize(run: RunDir, t0: float) -> dict[str, Any]:
    # The roles wrote the summary (evaluate merged its figures in) and set `latest`
    # (`roles.results`); the launcher adds only its own figure, the whole run's wall time.
    from hpctoolkit.output.figures import figure, seconds

    summary = merge_summary(run, {"wall_seconds": round(time.monotonic() - t0, 1)})
    say(
        f"done in {seconds(summary['wall_seconds'])}: {summary.get('samples_read')} samples, "
        f"{summary.get('keys_left_in_store')} keys left in the store, served acceptance length "
        f"{figure(summary.get('served_acceptance_length'))} at k={summary.get('served_k')} (vLLM, incl. bonus); "
        f"{trainer_acceptance_line(summary)} -> {run.summary} (also {run.latest}/summary.json)"
    )
    return summary
