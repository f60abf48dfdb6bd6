"""Hand a run to Slurm: a rendered batch script through `sbatch`, or the role dispatch through submitit.

Both take their topology from the `Plan`, never from numbers typed twice. `sbatch` runs through
`hpctoolkit.slurm.shell.run`, the package's one place for one-shot commands.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.placement import Plan
from hpctoolkit.slurm import shell
from hpctoolkit.slurm.env import time_limit_minutes
from hpctoolkit.slurm.render import render_sbatch

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
    script = Path(workdir) / ".hpctoolkit-submit.sbatch"
    if args:
        # sbatch passes script arguments only to a script file, not to one read from stdin.
        script.write_text(script_text)
        out = shell.run(["sbatch", "--parsable", str(script), *args], cwd=workdir, env=env)
    else:
        out = shell.run(["sbatch", "--parsable"], stdin=script_text, cwd=workdir, env=env)
    line = out.strip().splitlines()[-1] if out.strip() else ""
    m = _JOB_ID.match(line)
    if not m:
        raise RuntimeError(f"sbatch printed no job id: {out!r}")
    return m.group(1)


def submit_job(cfg: Any, plan: Plan, *, recipe_path: str, overrides: Sequence[str] = ()) -> str:
    """Render the run's batch script, keep a copy in the output folder, submit it from here."""
    text = render_sbatch(cfg, plan, recipe_path=recipe_path, overrides=overrides)
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.sbatch").write_text(text)
    return submit_sbatch(text, Path.cwd())


def executor_parameters(cfg: Any, plan: Plan) -> dict[str, Any]:
    """submitit `SlurmExecutor` parameters derived from the plan. Pure."""
    c = cfg.cluster
    if plan.backend != "slurm":
        raise ConfigError(f"submitit needs cluster.backend=slurm, got {plan.backend!r}")
    params: dict[str, Any] = {
        "job_name": c.job_name,
        "nodes": plan.num_nodes,
        # Every node gets the same task count; tasks beyond a node's processes return at once.
        "ntasks_per_node": plan.max_processes_per_node(),
        "gpus_per_node": plan.gpus_per_node,
        "time": time_limit_minutes(c.time),
        "signal_delay_s": c.signal_before_s,
        "exclusive": bool(c.exclusive),
    }
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
    """Submit the role dispatch (`hpctoolkit.roles.dispatch.run_task`) as one submitit job of `plan.num_nodes`
    nodes; `job.results()` holds one entry per task (dry: the placement lines; None for spare tasks).

    Runs in the submitting interpreter's environment (submitit pickles the call); with
    `cluster.container` set, use the sbatch path, which wraps every step in `apptainer exec`.
    """
    import submitit

    from hpctoolkit.roles.dispatch import run_task

    if cfg.cluster.container:
        raise ConfigError(
            "cluster.container is set: submitit runs the submitting Python, not the image; "
            "submit the rendered batch script instead"
        )
    executor = submitit.SlurmExecutor(folder=str(folder))
    executor.update_parameters(**executor_parameters(cfg, plan))
    return executor.submit(run_task, plan, recipe_path, list(overrides), dry)
