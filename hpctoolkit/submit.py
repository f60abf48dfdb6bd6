"""`python -m hpctoolkit.submit RECIPE [section.key=value ...] [--dry-run [--json]] [--render-sbatch]`

RECIPE `default` is the embedded default `make run` takes: recipes/local_gpu.yaml where a CUDA GPU
and vLLM's CUDA build are present, else recipes/local.yaml (`recipe.defaults`; the plan printout
says which and why).

Validates the recipe and its overrides, plans where every part runs and sizes the store, then
either prints that plan (`--dry-run`; `--json`: as one JSON object), prints the batch script
(`--render-sbatch`), runs the whole job on this machine (`cluster.backend: local`) or submits it
to Slurm (`cluster.backend: slurm`). Before a dry run or a submission ends, the files the run reads
(target, draft, prompts) must exist; every data row the run reads is read and normalised, and each
file must hold the rows the run takes from it (`data.num_samples`, plus the held-out evaluation's);
`engine.extra_args` must be vLLM engine arguments (checked where vLLM imports, else said so);
where `sinfo` reports node memory the busiest node's store segments, buffers and workers must fit
in it; and a job resuming a run by hand (`HPCTOOLKIT_RUN_ID`) must have the recipe and inputs the
run was pinned to (`rundir.inputs_record`). Every field of the recipe is checked against its declared kind first (`config/fields.py`),
and each flag against the recipe's `cluster.backend` (`FLAG_BACKENDS`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hpctoolkit.cli import parse, parser, run_cli
from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.placement import Plan, make_plan
from hpctoolkit.plan.sizing import StoreSizing, check_free_space, check_node_memory
from hpctoolkit.recipe.couplings import store_sizing
from hpctoolkit.recipe.load import load_pinned
from hpctoolkit.recipe.schema import RecipeConfig

# The `cluster.backend`s each flag fits, by its argparse dest: a flag given with a recipe of
# another backend is refused once the recipe is read, naming the field, before anything runs.
FLAG_BACKENDS: dict[str, tuple[str, ...]] = {"render_sbatch": ("slurm",)}


def check_flags(args: Any, cfg: RecipeConfig) -> None:
    """Each flag given against `FLAG_BACKENDS`; `ConfigError` naming `cluster.backend` and the flag."""
    for dest, backends in FLAG_BACKENDS.items():
        if getattr(args, dest) and cfg.cluster.backend not in backends:
            flag = "--" + dest.replace("_", "-")
            raise ConfigError(
                f"cluster.backend must be {' or '.join(backends)} for {flag}, got {cfg.cluster.backend!r} "
                f"(in {args.recipe} or its overrides)"
            )


def check_files(cfg: RecipeConfig) -> None:
    """The files the run reads exist here (the submit host sees the shared paths the nodes do)."""
    wanted = [
        ("paths.target_model", cfg.paths.target_model, "dir"),
        ("draft.config", cfg.draft.config, "file"),
    ]
    wanted.append(("data.prompts", cfg.data.prompts, "file"))
    if cfg.data.draft_vocab:
        wanted.append(("data.draft_vocab", cfg.data.draft_vocab, "file"))
    wanted += [(f"data.sources[{i}].path", src.path, "file") for i, src in enumerate(cfg.data.sources)]
    for key, path, kind in wanted:
        if not path or path.startswith(("builtin:", "pypi:")):
            continue
        p = Path(path)
        ok = p.is_dir() and (p / "config.json").is_file() if kind == "dir" else p.is_file()
        if not ok:
            what = "a model directory with config.json" if kind == "dir" else "a file"
            raise ConfigError(f"{key}={path} is not {what}")
    if cfg.data.draft_vocab:  # read by the trainers, at the end of the capture: read it here first
        from hpctoolkit.rundir.atomic import read_json_object

        read_json_object(cfg.data.draft_vocab, "data.draft_vocab")


def check_resumed_inputs(cfg: RecipeConfig, recipe_yaml: str) -> None:
    """A job that resumes a run by hand (`HPCTOOLKIT_RUN_ID` names its directory) is refused here,
    at submission, when its recipe or an input differs from what the run pinned; its steps would
    refuse it anyway, after the queue wait (`rundir.inputs_record`)."""
    from hpctoolkit import envs
    from hpctoolkit.roles.measure_inputs import measure
    from hpctoolkit.rundir import inputs_record
    from hpctoolkit.rundir.layout import RunDir

    run_id = envs.get(envs.HPCTOOLKIT_RUN_ID.name)
    if cfg.cluster.backend == "slurm" and run_id:
        inputs_record.check(RunDir.of(cfg.paths.output_dir, run_id), measure(cfg, recipe_yaml))


def check_data(cfg: RecipeConfig) -> int:
    """Every data row the run reads is read and normalised here, and each file holds enough rows
    (`data.prompts.check_rows`); returns how many rows were checked."""
    from hpctoolkit.data.prompts import check_rows

    ev = cfg.evaluate
    held_out = ev.num_prompts if ev.enabled and ev.prompts == "held_out" else 0
    return check_rows(cfg.data, held_out)


def check_memory(cfg: RecipeConfig, sized: StoreSizing) -> int | None:
    """Where `sinfo` reports the partition's node memory, the busiest node must fit in it."""
    if cfg.cluster.backend != "slurm":
        return None
    from hpctoolkit.slurm.sinfo import node_memory_bytes

    have = node_memory_bytes(cfg.cluster.partition)
    if have is not None:
        check_node_memory(sized.nodes, have, cfg.cluster.partition)
    return have


def check_disk(cfg: RecipeConfig, sized: StoreSizing) -> None:
    """Free space where the run writes (`paths.output_dir`'s disk: its nearest existing folder)
    against the spool's worst case; a run that cannot fit is refused before anything starts."""
    if not sized.spool_bytes:
        return
    import shutil

    where = Path(str(cfg.paths.output_dir)).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    check_free_space(sized.spool_bytes, shutil.disk_usage(where).free, str(where))


def plan_json(cfg: RecipeConfig, plan: Plan, sized: StoreSizing, node_memory: int | None) -> dict[str, Any]:
    return {
        "recipe": cfg.name,
        "backend": plan.backend,
        "digest": plan.digest(),
        "nodes": plan.num_nodes,
        "total_gpus": plan.total_gpus,
        "inference_gpus": plan.engine_gpus,
        "training_gpus": plan.trainer_gpus,
        "engines": [
            {
                "index": e.index,
                "tp": e.tp,
                "pp": e.pp,
                "nodes": [n.node for n in e.nodes],
                "gpus_per_node": len(e.leader.gpus),
                "leader": e.leader.node,
            }
            for e in plan.engines
        ],
        "trainer": {
            "world_size": plan.trainer.world_size,
            "nodes": list(plan.trainer.nodes),
            "ranks_per_node": plan.trainer.ranks_per_node,
            "gpus": [[r.node, r.gpu] for r in plan.trainer.ranks],
            "fsdp_mode": plan.trainer.fsdp_mode,
        },
        "master": None if plan.master is None else {"node": plan.master.node, "port": plan.master.port},
        "store": sized.to_dict(),
        "node_memory_bytes": node_memory,
    }


def describe(cfg: RecipeConfig, plan: Plan | None, sized: StoreSizing) -> str:
    num_layers, capture = sized.num_layers, list(sized.capture_ids)
    e, s, t = cfg.engine, cfg.store, cfg.training
    where = s.bind_host if cfg.cluster.backend == "local" else "the planned node's address"
    master = f"connect to {s.master_address}" if s.master_address else f"launch our own on {where}"
    lines = [
        f"recipe      {cfg.name}  (backend: {cfg.cluster.backend})",
        f"output      {cfg.paths.output_dir}",
        f"target      {cfg.paths.target_model}  ({num_layers} layers)",
        f"draft       {cfg.draft.config}",
        f"capture     target layers {list(e.target_layer_ids)} -> capture ids {capture} (last = last_hidden_states)",
        f"engine      {e.num_engines} x (TP={e.tp_size} x PP={e.pp_size}) over {e.nnodes} node(s) each, {e.dtype}",
        *(
            [
                f"regenerate  {e.regenerate_replicas} generating engines per engine GPU "
                f"(engine.regenerate_replicas), each on every {e.regenerate_replicas}th row with "
                f"1/{e.regenerate_replicas} of its memory: one engine's scheduler keeps a small "
                "target's GPU mostly idle"
            ]
            if e.regenerate_replicas > 1 and cfg.data.regenerate_tokens
            else []
        ),
        f"store       Mooncake master: {master}; lease {s.kv_lease_ttl_s}s; reader retry {s.get_retry_max_wait_seconds}s",
        f"training    {t.steps} steps, {t.world_size} rank(s), FSDP {t.fsdp_mode}, device {t.device}, "
        f"{t.mixed_precision}",
    ]
    if plan is not None:
        lines += ["", plan.describe()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = parser("hpctoolkit.submit", __doc__)
    ap.add_argument("recipe", help="recipe YAML, e.g. recipes/local.yaml; 'default': make run's choice")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the plan; start nothing")
    ap.add_argument("--json", action="store_true", help="with --dry-run: print the plan as one JSON object")
    ap.add_argument("--render-sbatch", action="store_true", help="print the Slurm batch script and exit")
    args = parse(ap, argv)
    if args.json and not args.dry_run:
        raise ConfigError("--json prints the plan of a dry run: give --dry-run too")

    chosen = None
    if args.recipe == "default":
        from hpctoolkit import envs
        from hpctoolkit.recipe import defaults

        chosen = defaults.choose(defaults.probe(), envs.get(envs.HPCTOOLKIT_DEFAULT_RECIPE.name))
        args.recipe = chosen.recipe
    if args.render_sbatch:
        # The script is rendered before the job's paths exist: `???` values stay open and become
        # arguments of `sbatch`; the couplings run on the nodes, where the files are.
        from hpctoolkit.slurm.render import load_for_render, render_sbatch

        cfg, _ = load_for_render(args.recipe, args.overrides)
        check_flags(args, cfg)
        sys.stdout.write(
            render_sbatch(cfg, make_plan(cfg), recipe_path=args.recipe, overrides=args.overrides)
        )
        return 0
    cfg, recipe_yaml = load_pinned(args.recipe, args.overrides)
    check_flags(args, cfg)
    plan = make_plan(cfg)
    sized = store_sizing(cfg, plan)
    check_files(cfg)
    check_data(cfg)
    check_resumed_inputs(cfg, recipe_yaml)
    if cfg.engine.extra_args:
        from hpctoolkit.engine.vllm_args import check_extra_args

        skipped = check_extra_args(cfg.engine.extra_args)
        if skipped:
            print(skipped, file=sys.stderr)
    node_memory = check_memory(cfg, sized)
    check_disk(cfg, sized)
    if args.json:
        print(json.dumps(plan_json(cfg, plan, sized, node_memory), indent=2))
        return 0
    if chosen is not None:
        print(chosen.describe())
    print(describe(cfg, plan, sized))
    print(sized.describe())
    if args.dry_run:
        print("\ndry run: recipe is valid; nothing was started.")
        return 0
    if cfg.cluster.backend == "slurm":
        from hpctoolkit.slurm.handoff import submit_job

        # Through submitit; `sbatch` of the rendered script (--render-sbatch) is the shell path.
        _, told = submit_job(cfg, plan, recipe_path=args.recipe, overrides=args.overrides)
        print(told)
        return 0
    from hpctoolkit.roles.local import run_local
    from hpctoolkit.targets.resolve import resolve_target

    # The run needs its target now: a packaged one is converted here, once, before the roles start
    # (loading the recipe only read its header). Under Slurm each node's roles convert it.
    resolve_target(cfg.paths.target_model)
    run_local(cfg, plan, args.recipe, args.overrides)
    return 0


if __name__ == "__main__":
    run_cli(main)
