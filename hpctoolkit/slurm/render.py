"""Render the Slurm batch script of a run. Pure: text in, text out, tested against golden files.

Everything in the script derives from the `Plan`: `#SBATCH --nodes` is the plan's node count, and
every role is one `srun` step pinned to its node(s) with `--nodelist` (with `evaluate.enabled`, the
evaluate role is one more step after the engines drained, on trainer rank 0's node), the hosts
taken from `scontrol show hostnames` at run time (node index i = i-th host). The script's sections
are the phases of `plan.lifecycle`, in order, each announced in the job's log
(`[hpctoolkit] phase NAME`); its conditions become the shell's tests on the trainers' status. Each step runs
`python -m hpctoolkit.roles ROLE RECIPE OVERRIDES...`, inside `apptainer exec --nv` when
`cluster.container` is set, with the paths the recipe names bound where they lie outside the
image (`hpctoolkit.slurm.container`; the script binds paths given as sbatch arguments itself). The
script exports the plan's digest; every node recomputes its plan from the recipe and overrides and
refuses to start if the two differ.

Recipes may leave values as `???` (the production recipe leaves its paths to the site). Such a
recipe still renders (`load_for_render`): the script then expects those keys as arguments to
`sbatch`, which it appends to the overrides of every step.
"""

from __future__ import annotations

import os
import posixpath
import shlex
from collections.abc import Callable, Sequence

from hpctoolkit.plan import lifecycle
from hpctoolkit.plan.placement import (
    ROLE_EVALUATE,
    ROLE_MASTER,
    ROLE_TRAINER,
    Plan,
    span,
)
from hpctoolkit.plan.sizing import node_memory
from hpctoolkit.recipe.schema import RecipeConfig
from hpctoolkit.rundir.ledger import PREEMPTED_EXIT
from hpctoolkit.slurm import container

# Stands in for a `???` value while rendering; the value must come as an sbatch argument.
DEFERRED = "<given-at-submission>"
# Every step runs `python -m hpctoolkit.roles ROLE RECIPE OVERRIDES...`.
ROLES_MODULE = "hpctoolkit.roles"
# `lifecycle.Seen.clean` in the shell: the trainers exited 0 and no SIGUSR2 came.
CLEAN_TEST = "rc == 0 && !late"


def load_for_render(
    path: str | os.PathLike[str], overrides: Sequence[str] = ()
) -> tuple[RecipeConfig, list[str]]:
    """Compose a recipe whose `???` values are still open; returns the config and the open keys.

    Nothing here reads the target or draft files (the couplings run on the nodes, where the paths
    are known); the placement only needs the engine, training, store and cluster sections.
    """
    from omegaconf import OmegaConf

    from hpctoolkit.recipe.load import compose, override_data, recipe_data

    given = {o.partition("=")[0] for o in overrides}
    try:
        data = recipe_data(path)
        merged = OmegaConf.merge(OmegaConf.structured(RecipeConfig), data, override_data(overrides))
        # OmegaConf drops a `???` merged over a schema default, so look at the YAML itself too.
        raw = {k for k in _raw_missing(data) if k not in given}
        missing = sorted(set(OmegaConf.missing_keys(merged)) | raw)
    except Exception:  # noqa: BLE001 - compose below raises the user-facing ConfigError
        missing = []
    cfg = compose(path, [*overrides, *(f"{k}={DEFERRED}" for k in missing)])
    return cfg, missing


def _raw_missing(data: object, prefix: str = "") -> list[str]:
    if isinstance(data, dict):
        return [k for key, v in data.items() for k in _raw_missing(v, f"{prefix}{key}.")]
    return [prefix.rstrip(".")] if data == "???" else []


def _q(text: str) -> str:
    return shlex.quote(str(text))


def _deferred(cfg: RecipeConfig) -> list[str]:
    """Keys whose value was `???` at render time (they must come as sbatch arguments)."""
    from hpctoolkit.recipe.schema import SECTIONS

    return [
        f"{section}.{name}"
        for section in SECTIONS
        for name, value in vars(getattr(cfg, section)).items()
        if value == DEFERRED
    ]


def _sbatch_lines(cfg: RecipeConfig, plan: Plan) -> list[str]:
    c = cfg.cluster
    out = cfg.paths.output_dir
    output = "%x-%j.out" if out == DEFERRED else f"{out.rstrip('/')}/slurm-%j.out"
    lines = [
        f"--job-name={c.job_name}",
        f"--nodes={plan.num_nodes}",
        # CPUs for the busiest node's processes (the master and the trainers share node 0).
        f"--ntasks-per-node={plan.max_processes_per_node()}",
        f"--gpus-per-node={plan.gpus_per_node}",
    ]
    if c.exclusive:
        lines.append("--exclusive")
    if c.host_memory_per_worker:
        # The busiest node's store segments + buffers + its workers' allowance (plan.sizing).
        need = max(n.total_bytes for n in node_memory(cfg, plan))
        lines.append(f"--mem={-(-need // (1 << 20))}M")
    lines.append(f"--time={c.time}")
    if c.partition:
        lines.append(f"--partition={c.partition}")
    if c.account:
        lines.append(f"--account={c.account}")
    # --requeue: a preempted job (the trainers checkpointed on USR2) requeues itself, below; its
    # next attempt appends to the same log.
    lines += [f"--output={output}", "--open-mode=append", f"--signal=B:USR2@{c.signal_before_s}", "--requeue"]
    lines += list(c.sbatch_extra or [])
    return [f"#SBATCH {line}" for line in lines]


def _srun(
    *, nodes: Sequence[int], ntasks: int, gpus_per_node: int, name: str, extra: Sequence[str] = ()
) -> str:
    hosts = " ".join(str(i) for i in nodes)
    opts = [
        f"--job-name={name}",
        f"--nodes={len(nodes)}",
        f"--ntasks={ntasks}",
        # Explicit, or srun would inherit the job's --ntasks-per-node from the environment.
        f"--ntasks-per-node={ntasks // len(nodes)}",
        f'--nodelist="$(hosts {hosts})"',
        f"--gres=gpu:{gpus_per_node}",
        *extra,
    ]
    return "srun " + " ".join(opts)


def _role_command(role: str) -> str:
    return f'"${{RUN[@]}}" -m {ROLES_MODULE} {role} "$RECIPE" "${{OVERRIDES[@]}}"'


def _step(
    *,
    comment: str,
    nodes: Sequence[int],
    ntasks: int,
    gpus_per_node: int,
    role: str,
    name: str,
    var: str,
    extra: Sequence[str] = (),
) -> list[str]:
    return [
        f"# {comment}",
        _srun(nodes=nodes, ntasks=ntasks, gpus_per_node=gpus_per_node, name=name, extra=extra) + " \\",
        f"  {_role_command(role)} &",
        f"{var}=$!",
    ]


def render_sbatch(cfg: RecipeConfig, plan: Plan, *, recipe_path: str, overrides: Sequence[str] = ()) -> str:
    """The batch script that runs `plan`, its phases those of `plan.lifecycle` in order (a phase
    the run skips renders nothing). Byte-identical for identical inputs."""
    if plan.backend != "slurm":
        raise ValueError(f"render_sbatch needs a slurm plan, got backend {plan.backend!r}")
    baked = [o for o in overrides if DEFERRED not in o]
    body = [
        *_head(cfg, plan, recipe_path, baked),
        *_sbatch_lines(cfg, plan),
        "set -euo pipefail",
        "",
        f"export HPCTOOLKIT_PLAN_DIGEST={plan.digest()}",
        f"RECIPE={_q(recipe_path)}",
        "OVERRIDES=(" + " ".join(_q(o) for o in baked) + (' "$@")' if baked else '"$@")'),
        *_run_lines(cfg, recipe_path),
        "",
        *_hosts_lines(plan),
        "# The run's phases (hpctoolkit.plan.lifecycle), each announced in the job's log.",
        'phase() { echo "[hpctoolkit] phase $1"; }',
    ]
    shape = lifecycle.RunShape.of(plan, cfg.evaluate.enabled)
    render: dict[str, Callable[[], list[str]]] = {
        "start": _start_lines,
        "master": lambda: _master_lines(plan),
        "engines": lambda: _engine_lines(plan),
        "trainers": lambda: _trainer_lines(plan),
        "drain": lambda: _drain_lines(plan),
        "evaluate": lambda: _evaluate_lines(plan),
        "stop": lambda: _stop_lines(plan),
        "end": lambda: _end_lines(shape),
    }

    def announce(p: lifecycle.Phase) -> None:
        # A phase entered on the trainers' outcome announces itself where the script decides.
        said = [f"phase {p.name}"] if p.enter != lifecycle.CLEAN_AND_ENABLED else []
        body.extend(["", f"# Phase {p.name}: {p.what}.", *said])

    # The driver's backend that emits each phase's statements instead of running them: it walks as
    # a clean run (every phase some outcome enters); the shell's tests on the trainers' status decide.
    hooks = {name: (lambda _seen, lines=lines: body.extend(lines())) for name, lines in render.items()}
    lifecycle.drive("batch-script", hooks, shape, announce, seen=lifecycle.Seen(trainers_rc=0))
    return "\n".join(body) + "\n"


def _head(cfg: RecipeConfig, plan: Plan, recipe_path: str, baked: Sequence[str]) -> list[str]:
    first = shlex.join(["python", "-m", "hpctoolkit.submit", recipe_path, *baked])
    head = [
        "#!/bin/bash",
        f"# Generated by hpctoolkit.slurm.render from {recipe_path}; do not edit by hand.",
        f"# Regenerate: {first} --render-sbatch",
        f"# Placement (digest {plan.digest()}):",
        *(f"#   {line}" if line else "#" for line in plan.describe().splitlines()),
    ]
    deferred = _deferred(cfg)
    if deferred:
        head += [
            "# The recipe leaves these as ???; give them as arguments to sbatch (they are appended",
            "# to every step's overrides):",
            f"#   sbatch <this script> {' '.join(f'{k}=...' for k in deferred)}",
        ]
    return head


def _run_lines(cfg: RecipeConfig, recipe_path: str) -> list[str]:
    """`RUN`, the interpreter every step runs: the image's python3 with what the recipe names
    bound (`hpctoolkit.slurm.container`), or the python on PATH without a container."""
    image = cfg.cluster.container
    if not image or image == DEFERRED:
        return ['RUN=("${HPCTOOLKIT_PYTHON:-python3}")']
    pairs = [*container.config_paths(cfg, skip=DEFERRED), ("recipe", recipe_path)]
    binds = container.bind_paths(pairs)
    out_dir = cfg.paths.output_dir
    lines = ["# Steps run in the image; what the recipe names outside it is bound at the same path."]
    if out_dir != DEFERRED and posixpath.normpath(out_dir) in binds:
        lines.append(f"mkdir -p -- {_q(posixpath.normpath(out_dir))}")
    lines.append("RUN=(" + " ".join(_q(a) for a in container.exec_prefix(binds)) + ")")
    keys = " | ".join(f"{k}=*" for k in container.BIND_KEYS)
    roots = " | ".join(f"{_q(r)} | {_q(r)}/*" for r in container.IMAGE_ROOTS)
    lines += [
        "# So are the paths given as sbatch arguments (KEY=PATH, appended to the overrides).",
        'for arg in "$@"; do',
        "  case $arg in",
        f"    {keys}) path=${{arg#*=}} ;;",
        "    *) continue ;;",
        "  esac",
        "  case $path in",
        f"    {roots}) ;;",
        "    /*)",
        f'      if [[ $arg == {container.OUTPUT_KEY}=* ]]; then mkdir -p -- "$path"; fi',
        '      RUN+=(--bind "$path") ;;',
        "  esac",
        "done",
        f"RUN+=({_q(image)} {container.IMAGE_PYTHON})",
    ]
    return lines


def _hosts_lines(plan: Plan) -> list[str]:
    return [
        "# Node index i of the plan is the i-th host of the allocation.",
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f"if (( ${{#HOSTS[@]}} != {plan.num_nodes} )); then",
        f'  echo "expected {plan.num_nodes} nodes, the allocation has ${{#HOSTS[@]}}" >&2',
        "  exit 1",
        "fi",
        "hosts() {",
        "  local i out=()",
        '  for i in "$@"; do out+=("${HOSTS[$i]}"); done',
        '  (IFS=,; echo "${out[*]}")',
        "}",
        'echo "hosts=$(hosts "${!HOSTS[@]}")"',
    ]


def _start_lines() -> list[str]:
    return [
        "# Fail before any step starts if the recipe does not load or its plan differs from this one.",
        f'"${{RUN[@]}}" -m {ROLES_MODULE} check "$RECIPE" "${{OVERRIDES[@]}}"',
    ]


def _master_lines(plan: Plan) -> list[str]:
    m = plan.master
    assert m is not None
    return _step(
        comment=f"Mooncake master on n{m.node} ({m.rule}); shares its node's CPUs with the trainers.",
        nodes=[m.node],
        ntasks=1,
        gpus_per_node=0,
        role=ROLE_MASTER,
        name="master",
        var="master_pid",
        extra=["--overlap"],
    )


def _engine_vars(plan: Plan) -> list[str]:
    return [f"engine{e.index}_node{n.node_rank}_pid" for e in plan.engines for n in e.nodes]


def _engine_lines(plan: Plan) -> list[str]:
    body: list[str] = []
    for e in plan.engines:
        for n in e.nodes:
            who = "leader" if n.node_rank == 0 else "headless follower"
            body += _step(
                comment=(
                    f"Engine {e.index} node_rank {n.node_rank} ({who}) on n{n.node}: GPUs {span(n.gpus)}, "
                    f"PP stage {','.join(map(str, n.pp_stages))} of TP={e.tp} x PP={e.pp}."
                ),
                nodes=[n.node],
                ntasks=1,
                gpus_per_node=len(n.gpus),
                role=n.role,
                name=f"engine{e.index}-{n.node_rank}",
                var=f"engine{e.index}_node{n.node_rank}_pid",
            )
            body.append("")
    return body[:-1]


def _trainer_lines(plan: Plan) -> list[str]:
    """The trainers' step; SIGUSR2 on the batch shell is forwarded to them; wait for them."""
    t = plan.trainer
    return [
        *_step(
            comment=(
                f"FSDP trainers ({t.fsdp_mode}): {t.world_size} rank(s), {t.ranks_per_node} per node on "
                + ", ".join(f"n{i}" for i in t.nodes)
                + "."
            ),
            nodes=t.nodes,
            ntasks=t.world_size,
            # CPU (gloo) trainers take no GPU.
            gpus_per_node=t.ranks_per_node if t.device == "cuda" else 0,
            role=ROLE_TRAINER,
            name="trainer",
            var="trainer_pid",
            extra=["--kill-on-bad-exit=1"],
        ),
        "",
        "# The time limit is near: the trainers checkpoint on SIGUSR2 (srun forwards it to its tasks).",
        "late=0",
        "# shellcheck disable=SC2317  # invoked by the trap below",
        "on_usr2() {",
        "  late=1",
        '  echo "SIGUSR2: asking the trainers to checkpoint" >&2',
        '  kill -USR2 "$trainer_pid" 2>/dev/null || true',
        "}",
        "trap on_usr2 USR2",
        "",
        *_watch_lines(plan),
        'echo "trainers exited with status $rc"',
    ]


def _watch_lines(plan: Plan) -> list[str]:
    """The lifecycle's watch: until the trainers end, a step that exits non-zero ends the run; its
    role is named (`roles.verdict`: the one of the step that died, when none said how it left)."""
    steps = [("master", "master_pid")] if plan.master is not None else []
    steps += [
        (f"engine{e.index}-{n.node_rank}", f"engine{e.index}_node{n.node_rank}_pid")
        for e in plan.engines
        for n in e.nodes
    ]
    poll = lifecycle.WATCH_POLL_S
    return [
        "# The run ends with the trainers. Until then every step is watched: one that exits non-zero",
        "# (a role failed, or died without a word: SIGKILL, the OOM killer) ends the run; the others",
        "# are ended below. A service step that exits 0 (an engine once drained) only leaves the watch.",
        "watched=(" + " ".join(f'{name} "${var}"' for name, var in steps) + ")",
        "failed_step=''",
        "failed_status=0",
        "rc=0",
        "while :; do",
        "  # kill -0 fails once bash has reaped the step; wait then returns its status at once.",
        '  if ! kill -0 "$trainer_pid" 2>/dev/null; then',
        '    wait "$trainer_pid" && rc=0 || rc=$?',
        "    break",
        "  fi",
        "  for ((i = 0; i < ${#watched[@]}; i += 2)); do",
        "    pid=${watched[i + 1]}",
        '    if [[ -z $pid ]] || kill -0 "$pid" 2>/dev/null; then continue; fi',
        "    watched[i + 1]=''",
        "    st=0",
        '    wait "$pid" || st=$?',
        "    if ((st != 0)); then",
        "      failed_step=${watched[i]} failed_status=$st",
        "      break 2",
        "    fi",
        "  done",
        f"  sleep {poll}",
        "done",
        "if [[ -n $failed_step ]]; then",
        '  echo "step $failed_step exited with status $failed_status before the trainers ended; ending the run" >&2',
        *_died_lines("$failed_step", "$failed_status", indent="  "),
        '  kill -TERM "$trainer_pid" 2>/dev/null || true',
        '  wait "$trainer_pid" 2>/dev/null || true',
        "  rc=1",
        "fi",
    ]


def _died_lines(step: str, status: str, indent: str) -> list[str]:
    """Name the role of a failed step that died without a word (`roles.verdict`; nothing when each
    of its roles said how it left: their own error line is the run's)."""
    return [
        f"{indent}HPCTOOLKIT_FAILED_STEP={step} HPCTOOLKIT_FAILED_STATUS={status} \\",
        f'{indent}  "${{RUN[@]}}" -m {ROLES_MODULE} died "$RECIPE" "${{OVERRIDES[@]}}" || true',
    ]


def _drain_lines(plan: Plan) -> list[str]:
    grace = lifecycle.ENGINES_DRAIN_GRACE_S
    return [
        "# After a clean run (trainers exit 0, no SIGUSR2) the engines leave by themselves once the",
        f"# trainers drained them: wait for that, at most {grace} s; then end those left (at once otherwise).",
        "# srun turns SIGTERM into a step cancel: tasks get SIGTERM, then SIGKILL after KillWait.",
        "engines=(" + " ".join(f'"${v}"' for v in _engine_vars(plan)) + ")",
        f"if (({CLEAN_TEST})); then",
        f"  for _ in $(seq 1 {grace}); do",
        "    alive=0",
        '    for pid in "${engines[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done',
        "    ((alive)) || break",
        "    sleep 1",
        "  done",
        "fi",
        'for pid in "${engines[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done',
        'wait "${engines[@]}" 2>/dev/null || true',
    ]


def _stop_lines(plan: Plan) -> list[str]:
    if plan.master is None:
        return ["# The master is external: nothing of this job's is left to end."]
    return [
        "# The engines unmounted their store segments from the master on the way out.",
        'kill -TERM "$master_pid" 2>/dev/null || true',
        'wait "$master_pid" 2>/dev/null || true',
    ]


def _end_lines(shape: lifecycle.RunShape) -> list[str]:
    """The outcome (`lifecycle.outcome`): preempted requeues, else the trainers' status, else
    evaluate's."""
    body = [
        f"# The first rank to exit {PREEMPTED_EXIT} ends the others' tasks (--kill-on-bad-exit), and a notice",
        "# sent to the steps (scancel --signal=USR2) never reaches this shell: the step's status alone",
        "# does not say; the run's records do (every rank's part of a checkpoint written on SIGUSR2).",
        f"if ((rc != 0 && rc != {PREEMPTED_EXIT})) && "
        '"${RUN[@]}" -m hpctoolkit.roles preempted "$RECIPE" "${OVERRIDES[@]}"; then',
        f"  rc={PREEMPTED_EXIT}",
        "fi",
        "# Not preempted: a trainer rank that died without a word is named (the first rank to fail ends",
        "# the others: srun --kill-on-bad-exit).",
        f"if ((rc != 0 && rc != {PREEMPTED_EXIT})) && [[ -z $failed_step ]]; then",
        *_died_lines(lifecycle.TRAINER_STEP, "$rc", indent="  "),
        "fi",
        f"# {PREEMPTED_EXIT}: every trainer rank wrote its part of a checkpoint on SIGUSR2; the job goes",
        "# back to the queue and resumes from it in the same run directory (same job id).",
        f"if ((rc == {PREEMPTED_EXIT})); then",
        '  echo "requeueing job $SLURM_JOB_ID to resume from its checkpoint"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
    ]
    if shape.evaluate:
        body += ["# A clean run whose evaluate failed fails.", "((rc != 0)) || rc=$erc"]
    return [*body, 'exit "$rc"']


def _evaluate_lines(plan: Plan) -> list[str]:
    """`evaluate.enabled`: the evaluate role after a clean run, on trainer rank 0's node (its GPUs
    are free then); it merges its figures into summary.json and sets `latest`."""
    t = plan.trainer
    node = t.nodes[0]
    gpus = 1 if t.device == "cuda" else 0
    return [
        f"# Serve the exported draft with the target in vLLM on n{node} ({gpus} GPU) and merge served vs",
        "# simulated acceptance into summary.json; skipped when the time limit is near.",
        "erc=0",
        "if ((rc == 0 && late)); then",
        '  echo "evaluate skipped: the time limit is near; serve the export by hand:'
        ' python -m hpctoolkit.evaluate EXPORT_DIR --target TARGET" >&2',
        "elif ((rc == 0)); then",
        "  phase evaluate",
        "  " + _srun(nodes=[node], ntasks=1, gpus_per_node=gpus, name="evaluate") + " \\",
        f"    {_role_command(ROLE_EVALUATE)} || erc=$?",
        '  echo "evaluate exited with status $erc"',
        "fi",
    ]
