"""Hand a run to Slurm: the role dispatch through submitit, or a rendered batch script through `sbatch`.

The Slurm half of `python -m hpctoolkit.submit` (which validates, plans and sizes first).

Both take their topology from the `Plan`, never from numbers typed twice. `sbatch` runs through
`hpctoolkit.slurm.shell.run`, the package's one place for one-shot commands.

`python -m hpctoolkit.submit RECIPE` submits through submitit (`submit_job`): one job of
`plan.num_nodes` nodes and `tasks_per_node(plan)` tasks per node, every task running
`RoleTask` (the role its node and local task id pick, `slurm.tasks.task_process`), inside the image
when `cluster.container` is set (submitit's python command is `container.command_prefix`). Every
task writes to the one log `<paths.output_dir>/slurm-<job>.out`, as the batch script's steps do.
Preemption uses submitit's machinery: Slurm sends SIGUSR2 `cluster.signal_before_s` before the time
limit (or `scancel --signal=USR2`) to every task; the trainers checkpoint (`train.preempt`), the
engines stop capturing, and task 0 (`RoleTask.checkpoint`, called by submitit's handler) waits for
the trainers' end record within the lead time, then submitit requeues the job, which resumes from
the same run directory (`rundir.ledger`). A task that dies is noticed by its peers (their watch
and bounded waits; not `srun --kill-on-bad-exit`, which would end a requeue). The job ends when its tasks do: the trainers write
`ended.json`, the engines leave once drained, the master once every engine closed; with
`evaluate.enabled`, trainer rank 0's task then waits for the drain and runs the evaluate role
(`roles.dispatch.follow`), in the order `plan.lifecycle` gives every backend.

Which process task 0 runs so that submitit's requeue handler survives is `slurm.tasks`'s rule (the
master, or a watcher in its slot). That keeps every role free to own its signal handling; chaining
submitit's handler from the roles' instead would run submitit's blocking wait and `sys.exit` inside
the trainer's or an engine's handler, against the checkpoint the same signal asks for.
"""

from __future__ import annotations

import os
import re
import shlex
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpctoolkit import envs
from hpctoolkit.errors import ConfigError
from hpctoolkit.plan import lifecycle
from hpctoolkit.plan.placement import Plan
from hpctoolkit.slurm import shell
from hpctoolkit.slurm.env import time_limit_minutes
from hpctoolkit.slurm.tasks import tasks_per_node

_JOB_ID = re.compile(r"^(\d+)(?:;\S+)?$")


def submit_sbatch(
    script_text: str,
    workdir: str | os.PathLike,
    *,
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> str:
    """Submit `script_text` with `sbatch --parsable` from `workdir` (the job's working directory);
    return the job id. `args` go to the script ("$@": extra overrides)."""
    if args:
        # sbatch passes script arguments only to a script file, not to one read from stdin. Each
        # submission writes its own file (two submissions from one folder must not swap scripts);
        # Slurm keeps its own copy once sbatch returns, so the file goes with it.
        fd, name = tempfile.mkstemp(prefix=".hpctoolkit-submit-", suffix=".sbatch", dir=workdir)
        try:
            with os.fdopen(fd, "w") as fh:
                fh.write(script_text)
            out = shell.run(["sbatch", "--parsable", name, *args], cwd=workdir, env=env)
        finally:
            os.unlink(name)
    else:
        out = shell.run(["sbatch", "--parsable"], stdin=script_text, cwd=workdir, env=env)
    line = out.strip().splitlines()[-1] if out.strip() else ""
    m = _JOB_ID.match(line)
    if not m:
        raise RuntimeError(f"sbatch printed no job id: {out!r}")
    return m.group(1)


# From the trainers' end record to the job's end: the engines' drain, within the lifecycle's one
# grace (`plan.lifecycle`; the master's 0.5 s poll after it is inside its margin).
RELEASE_BOUND_S = lifecycle.ENGINES_DRAIN_GRACE_S


def submit_job(cfg: Any, plan: Plan, *, recipe_path: str, overrides: Sequence[str] = ()) -> tuple[str, str]:
    """Submit the run through submitit from here; return `(job id, what to tell the user)`."""
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    job = submit_submitit(
        cfg, plan, recipe_path=recipe_path, overrides=overrides, folder=out / "submitit" / "%j"
    )
    return job.job_id, describe_submission(cfg, job.job_id, out)


def describe_submission(cfg: Any, job_id: str, out: Path, environ: Mapping[str, str] | None = None) -> str:
    from hpctoolkit.rundir.layout import RunDir, slurm_run_id
    from hpctoolkit.rundir.ledger import complete_checkpoints

    env = os.environ if environ is None else environ
    # A by-hand resume names an earlier job's run directory; the job's tasks read the same variable.
    run = RunDir.of(out, env.get(envs.HPCTOOLKIT_RUN_ID.name) or slurm_run_id(cfg.name, job_id))
    done = complete_checkpoints(run.checkpoints)
    resumes = f" (resumes from its checkpoint {done[-1].name})" if done else ""
    log = out / f"slurm-{job_id}.out"
    return "\n".join(
        [
            f"submitted Slurm job {job_id}; its run directory is {run.root}{resumes}",
            f"log (every task):  {log}",
            f"submitit records:  {out / 'submitit' / job_id}",
            f"follow:            tail -F {log}    (state: squeue -j {job_id}; sacct -j {job_id})",
            f"cancel:            scancel {job_id}    (checkpoint and requeue: scancel --signal=USR2 {job_id})",
            f"the job releases its nodes within {RELEASE_BOUND_S} s of the trainers' end"
            + (" and trainer rank 0's evaluation" if cfg.evaluate.enabled else "")
            + f" (time limit {cfg.cluster.time}; SIGUSR2 {cfg.cluster.signal_before_s} s before it)",
        ]
    )


def executor_parameters(cfg: Any, plan: Plan) -> dict[str, Any]:
    """submitit `SlurmExecutor` parameters derived from the plan. Pure."""
    c = cfg.cluster
    if plan.backend != "slurm":
        raise ConfigError(f"submitit needs cluster.backend=slurm, got {plan.backend!r}")
    params: dict[str, Any] = {
        "job_name": c.job_name,
        "nodes": plan.num_nodes,
        # Every node gets the same task count; tasks beyond a node's processes return at once.
        "ntasks_per_node": tasks_per_node(plan),
        "gpus_per_node": plan.gpus_per_node,
        "time": time_limit_minutes(c.time),
        "signal_delay_s": c.signal_before_s,
    }
    if c.exclusive:
        # submitit writes `--exclusive=False` for False, which sbatch refuses.
        params["exclusive"] = True
    if c.partition:
        params["partition"] = c.partition
    if c.account:
        params["account"] = c.account
    return params


def submit_submitit(
    cfg: Any,
    plan: Plan,
    *,
    recipe_path: str,
    overrides: Sequence[str] = (),
    folder: str | os.PathLike,
    dry: bool = False,
) -> Any:
    """Submit `RoleTask` as one submitit job of `plan.num_nodes` nodes; `job.results()` holds one
    entry per task (dry: the placement lines; None for spare tasks).

    submitit pickles the call; a task unpickles it with the python of `container.command_prefix`
    (inside the image, the recipe's paths and the run's output directory bound) or, without
    `cluster.container`, the submitting interpreter.
    """
    executor = make_executor(cfg, plan, folder=folder, recipe_path=recipe_path, dry=dry)
    return executor.submit(RoleTask(), plan, recipe_path, list(overrides), dry)


def make_executor(
    cfg: Any, plan: Plan, *, folder: str | os.PathLike, recipe_path: str, dry: bool = False
) -> Any:
    """The submitit `SlurmExecutor` of `submit_submitit`, parameters set; submits nothing."""
    import submitit

    from hpctoolkit.slurm.container import command_prefix

    prefix = command_prefix(cfg, recipe_path=recipe_path)
    python = None if prefix is None else " ".join(shlex.quote(a) for a in prefix)
    executor = submitit.SlurmExecutor(folder=str(folder), python=python)
    params = executor_parameters(cfg, plan)
    # Not `--kill-on-bad-exit`: task 0 exits non-zero when submitit requeues the job on USR2, and
    # srun would then kill the other tasks mid-checkpoint and the job end FAILED (seen in
    # test_submitit_usr2_requeues_on_an_external_master). A dead task is noticed by its peers'
    # watch and the roles' bounded waits instead.
    srun_args: list[str] = []
    if cfg.paths.output_dir and not dry:
        log = str(Path(cfg.paths.output_dir) / "slurm-%j.out")
        srun_args += ["--output", log, "--error", log]
    params["srun_args"] = srun_args
    executor.update_parameters(**params)
    return executor


class RoleTask:
    """What every task of a submitit job runs; submitit's preemption handler calls `checkpoint` on
    task 0 (its global rank 0: the master or the watcher, `slurm.tasks.task_process`) and requeues the job when
    it returns a submission."""

    def __call__(self, plan: Plan, recipe: str, overrides: Sequence[str], dry: bool) -> Any:
        from hpctoolkit.roles.dispatch import run_task

        return run_task(plan, recipe, overrides, dry)

    def checkpoint(self, plan: Plan, recipe: str, overrides: Sequence[str], dry: bool) -> Any:
        """Wait (within the lead time) for the trainers' checkpoint, then resubmit this same call."""
        import submitit

        from hpctoolkit.recipe.load import load_recipe
        from hpctoolkit.roles.context import run_id_for
        from hpctoolkit.rundir.atomic import read_json
        from hpctoolkit.rundir.layout import RunDir
        from hpctoolkit.slurm.env import SlurmEnvironment

        if dry:
            return None
        cfg = load_recipe(recipe, list(overrides))
        senv = SlurmEnvironment.from_env()
        run = RunDir.of(cfg.paths.output_dir, run_id_for(cfg.name, senv, os.environ))
        # Leave Slurm a margin of the lead time for the requeue itself.
        deadline = time.monotonic() + max(5.0, cfg.cluster.signal_before_s - 10.0)
        ended = read_json(run.ended)
        while ended is None and time.monotonic() < deadline:
            time.sleep(0.2)
            ended = read_json(run.ended)
        if isinstance(ended, dict) and ended.get("ok"):
            return None  # trained to the end: nothing to resume
        # No end record in time: the next attempt resumes from the newest complete checkpoint.
        return submitit.helpers.DelayedSubmission(self, plan, recipe, list(overrides), dry)
