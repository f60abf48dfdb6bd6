"""The embedded run (`cluster.backend: local`, `make run`): the plan's roles as processes on this
machine, through the same role code and run directory as a Slurm job.

    master -> engine leaders (capture, publish) + trainers (read, train, export) -> evaluate

Each role is `python -m hpctoolkit.roles ROLE RECIPE OVERRIDES...` with this run's id and plan
digest in its environment; its output goes to `<run>/logs/<name>.log`, and its `[hpctoolkit...]`
progress lines also to the console. The first role to fail stops the run: the others are ended and
the failure comes back as one line naming the role, its error and its log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from hpctoolkit import envs, errors
from hpctoolkit.config.load import to_yaml
from hpctoolkit.config.schema import RecipeConfig
from hpctoolkit.errors import RoleFailedError
from hpctoolkit.plan.placement import ROLE_ENGINE_FOLLOWER, ROLE_ENGINE_LEADER, ROLE_TRAINER, Plan
from hpctoolkit.roles import console
from hpctoolkit.roles.console import speaker
from hpctoolkit.roles.results import merge_summary, trainer_line
from hpctoolkit.rundir import ledger
from hpctoolkit.rundir.atomic import read_json
from hpctoolkit.rundir.layout import RunDir, local_run_id

# Bounds of the launcher's own waits (the roles bound theirs).
MASTER_START_TIMEOUT_S = 120.0
ENGINES_EXIT_TIMEOUT_S = 300.0
SERVICE_EXIT_TIMEOUT_S = 60.0
STOP_GRACE_S = 15.0


say = speaker()


class RoleProcess:
    """One role process; its output is copied to its log, progress lines also to the console."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path):
        self.name, self.log = name, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[str] = log.open("a")
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

    def failure(self) -> Exception:
        """The error this role reported (run_cli's one line), as the same class where it is ours."""
        self._pump.join(timeout=5)
        lines = [x.strip() for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        said = next((x for x in reversed(lines) if x.startswith("error: ")), None)
        where = f"(exit code {self.proc.returncode}; log {self.log})"
        if said is None:
            last = lines[-1] if lines else "no output"
            return RoleFailedError(f"{self.name} failed: {last} {where}")
        kind, _, message = said[len("error: ") :].partition(": ")
        cls = getattr(errors, kind, None)
        if isinstance(cls, type) and issubclass(cls, Exception) and message:
            return cls(f"{self.name}: {message} {where}")
        return RoleFailedError(f"{self.name} failed: {said[len('error: ') :]} {where}")

    def stop(self) -> None:
        """SIGTERM to the role's process group, SIGKILL after a grace period."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(STOP_GRACE_S)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._pump.join(timeout=5)
        self._log.close()


class RoleGroup:
    """Every role process of one run; `wait` watches them all, so any failure stops the run."""

    def __init__(self, run: RunDir, recipe: str, overrides: Sequence[str], plan: Plan):
        self.run, self.recipe, self.overrides = run, recipe, list(overrides)
        self.env = dict(os.environ)
        self.env[envs.HPCTOOLKIT_RUN_ID.name] = run.run_id
        self.env[envs.HPCTOOLKIT_PLAN_DIGEST.name] = plan.digest()
        self.procs: list[RoleProcess] = []

    def start(self, name: str, role: str, **extra_env: str) -> RoleProcess:
        argv = [sys.executable, "-m", "hpctoolkit.roles", role, self.recipe, *self.overrides]
        p = RoleProcess(name, argv, {**self.env, **extra_env}, self.run.log(name))
        self.procs.append(p)
        return p

    def check(self) -> None:
        for p in self.procs:
            code = p.poll()
            if code not in (None, 0):
                raise p.failure()

    def wait(self, names: Sequence[RoleProcess], timeout_s: float | None, what: str) -> None:
        """Until every process of `names` exited 0; any role failing first raises its error."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.check()
            if all(p.poll() == 0 for p in names):
                return
            if deadline is not None and time.monotonic() > deadline:
                raise RoleFailedError(
                    f"{what} did not finish within {timeout_s:.0f}s; logs under {self.run.logs}"
                )
            time.sleep(0.2)

    def wait_for(self, predicate: Any, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not predicate():
            self.check()
            if time.monotonic() > deadline:
                raise RoleFailedError(f"{what} within {timeout_s:.0f}s; logs under {self.run.logs}")
            time.sleep(0.2)

    def stop_all(self) -> None:
        # Consumers first, then producers, the master last: nobody waits on a peer already gone.
        for p in reversed(self.procs):
            p.stop()


def start_run(cfg: RecipeConfig) -> RunDir:
    """A new run directory with this run's resolved recipe; never one an earlier run used."""
    run = RunDir.of(cfg.paths.output_dir, local_run_id(cfg.name))
    ledger.start_attempt(run, to_yaml(cfg), None, fresh=True)
    return run


def preflight(cfg: RecipeConfig, plan: Plan) -> None:
    """What can fail before a run directory exists: a given master that does not answer."""
    if plan.master is None:
        from hpctoolkit.store.mooncake import check_reachable

        check_reachable(plan.external_master or "", cfg.store.connect_timeout_s)


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_local(cfg: RecipeConfig, plan: Plan, recipe: str, overrides: Sequence[str]) -> dict[str, Any]:
    """Run the whole job on this machine; returns the summary (also `<run>/summary.json`)."""
    preflight(cfg, plan)
    run = start_run(cfg)
    t0 = time.monotonic()
    group = RoleGroup(run, recipe, overrides, plan)
    # Ended from outside (Ctrl-C, a batch system's SIGTERM): end the roles too.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        _start_roles(cfg, plan, group)
        trainers = [p for p in group.procs if p.name.startswith("trainer")]
        group.wait(trainers, None, "the trainers")
        engines = [p for p in group.procs if p.name.startswith("engine")]
        group.wait(engines, ENGINES_EXIT_TIMEOUT_S, "the engines (after the trainers drained them)")
        if cfg.evaluate.enabled:
            group.wait([group.start("evaluate", "evaluate")], None, "evaluate")
        group.wait(group.procs, SERVICE_EXIT_TIMEOUT_S, "the Mooncake master (after the run ended)")
    finally:
        group.stop_all()
        signal.signal(signal.SIGTERM, previous)
    return _summarize(run, t0)


def _start_roles(cfg: RecipeConfig, plan: Plan, group: RoleGroup) -> None:
    run = group.run
    if plan.master is not None:
        say(f"run {run.run_id} in {run.root}")
        group.start("master", "master")
        group.wait_for(
            lambda: read_json(run.master_record) is not None,
            MASTER_START_TIMEOUT_S,
            "the Mooncake master did not start",
        )
        master = read_json(run.master_record)
        if master is None:
            raise RoleFailedError(
                f"the Mooncake master's record {run.master_record} vanished after it started"
            )
        say(f"Mooncake master at {master['address']}")
    else:
        say(f"run {run.run_id} in {run.root}; Mooncake master {plan.external_master} (external)")
    for e in plan.engines:
        for node in e.nodes:
            role = ROLE_ENGINE_LEADER if node.node_rank == 0 else ROLE_ENGINE_FOLLOWER
            suffix = "" if node.node_rank == 0 else f".{node.node_rank}"
            group.start(f"engine{e.index}{suffix}", role)
    for r in plan.trainer.ranks:
        group.start(f"trainer{r.rank}", ROLE_TRAINER, RANK=str(r.rank))
    say(
        f"started {len(plan.engines)} engine(s) and {plan.trainer.world_size} trainer rank(s); logs in {run.logs}"
    )


def _summarize(run: RunDir, t0: float) -> dict[str, Any]:
    # The roles wrote the summary (evaluate merged its figures in) and set `latest`
    # (`roles.results`); the launcher adds only its own figure, the whole run's wall time.
    summary = merge_summary(run, {"wall_seconds": round(time.monotonic() - t0, 1)})
    say(
        f"done in {summary['wall_seconds']}s: {summary.get('samples_read')} samples, "
        f"{summary.get('keys_left_in_store')} keys left in the store, served acceptance length "
        f"{summary.get('served_acceptance_length')} at k={summary.get('served_k')} (vLLM, incl. bonus); "
        f"{trainer_line(summary)} -> {run.summary} (also {run.latest}/summary.json)"
    )
    return summary
