"""`python -m hpctoolkit.submit RECIPE [section.key=value ...] [--dry-run] [--render-sbatch]`

Validates the recipe and its overrides, plans where every part runs, then either prints that plan
(`--dry-run`), prints the batch script (`--render-sbatch`), runs the whole job on this machine
(`cluster.backend: local`) or submits it to Slurm (`cluster.backend: slurm`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from hpctoolkit.cli import parse, parser, run_cli
from hpctoolkit.config.load import load_recipe
from hpctoolkit.config.schema import RecipeConfig
from hpctoolkit.plan.placement import Plan, make_plan
from hpctoolkit.rundir.layout import slurm_run_id


def describe(cfg: RecipeConfig, plan: Plan | None) -> str:
    from hpctoolkit.capture import capture_ids_for
    from hpctoolkit.config.couplings import target_hf_config

    num_layers = target_hf_config(cfg.paths.target_model)["num_hidden_layers"]
    capture = capture_ids_for(cfg.engine.target_layer_ids, num_layers)
    e, s, t = cfg.engine, cfg.store, cfg.training
    where = s.bind_host if cfg.cluster.backend == "local" else "the planned node's address"
    master = f"connect to {s.master_address}" if s.master_address else f"launch our own on {where}"
    lines = [
        f"recipe      {cfg.name}  (backend: {cfg.cluster.backend})",
        f"output      {cfg.paths.output_dir}",
        f"target      {cfg.paths.target_model}  ({num_layers} layers)",
        f"draft       {cfg.draft.config}",
        f"capture     target layers {list(e.target_layer_ids)} -> capture ids {capture} (last = last_hidden_states)",
        f"engine      {e.num_engines} x (TP={e.tp_size} x PP={e.pp_size}) over {e.nnodes} node(s) each",
        f"store       Mooncake master: {master}; lease {s.kv_lease_ttl_s}s; reader retry {s.get_retry_max_wait_seconds}s",
        f"training    {t.steps} steps, {t.world_size} rank(s), FSDP {t.fsdp_mode}, device {t.device}",
    ]
    if plan is not None:
        lines += ["", plan.describe()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = parser("hpctoolkit.submit", __doc__)
    ap.add_argument("recipe", help="recipe YAML, e.g. recipes/local.yaml")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    ap.add_argument("--dry-run", action="store_true", help="validate and print the plan; start nothing")
    ap.add_argument("--render-sbatch", action="store_true", help="print the Slurm batch script and exit")
    args = parse(ap, argv)

    if args.render_sbatch:
        # The script is rendered before the job's paths exist: `???` values stay open and become
        # arguments of `sbatch`; the couplings run on the nodes, where the files are.
        from hpctoolkit.slurm.render import load_for_render, render_sbatch

        cfg, _ = load_for_render(args.recipe, args.overrides)
        sys.stdout.write(
            render_sbatch(cfg, make_plan(cfg), recipe_path=args.recipe, overrides=args.overrides)
        )
        return 0
    cfg = load_recipe(args.recipe, args.overrides)
    plan = make_plan(cfg)
    print(describe(cfg, plan))
    if args.dry_run:
        print("\ndry run: recipe is valid; nothing was started.")
        return 0
    if cfg.cluster.backend == "slurm":
        from hpctoolkit.slurm.submit import submit_job

        job = submit_job(cfg, plan, recipe_path=args.recipe, overrides=args.overrides)
        print(
            f"submitted Slurm job {job}; its run directory is {Path(cfg.paths.output_dir) / slurm_run_id(cfg.name, job)}"
        )
        return 0
    from hpctoolkit.roles.local import run_local

    run_local(cfg, plan, args.recipe, args.overrides)
    return 0


if __name__ == "__main__":
    run_cli(main)
