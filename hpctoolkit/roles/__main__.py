"""`python -m hpctoolkit.roles ROLE RECIPE [section.key=value ...]`: one role of a run."""

from __future__ import annotations

from hpctoolkit.cli import parse, parser, run_cli
from hpctoolkit.plan.placement import ROLE_EVALUATE, ROLES
from hpctoolkit.recipe.load import to_yaml
from hpctoolkit.roles.context import load_context, pinned_of, select_process
from hpctoolkit.roles.dispatch import run_process
from hpctoolkit.roles.evaluate import run_evaluate
from hpctoolkit.roles.heartbeat import guard_process_group
from hpctoolkit.roles.verdict import run_died
from hpctoolkit.rundir import ledger

ROLE_CHECK = "check"
# Not a role: exit 0 when this attempt's trainers checkpointed on SIGUSR2 (the batch script asks).
ROLE_PREEMPTED = "preempted"
# Not a role: name the role of a failed step that died (the batch script asks; `roles.verdict`).
ROLE_DIED = "died"
ALL_ROLES = (ROLE_CHECK, *ROLES, ROLE_EVALUATE, ROLE_PREEMPTED, ROLE_DIED)


def main(argv: list[str]) -> int:
    ap = parser("hpctoolkit.roles", __doc__)
    ap.add_argument("role", choices=ALL_ROLES, help="the role this process runs")
    ap.add_argument("recipe", help="the run's recipe YAML")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    args = parse(ap, argv)
    ctx = load_context(args.recipe, args.overrides)
    if args.role == ROLE_CHECK:
        # Once per attempt, before any step: the run directory, its pinned inputs (refused when
        # changed since the first attempt) and the resolved recipe it runs with.
        job_id = None if ctx.slurm is None else ctx.slurm.job_id
        if ledger.start_attempt(ctx.run, to_yaml(ctx.cfg), pinned_of(ctx), job_id):
            print(f"attempt {ledger.restart_count()} of job {job_id}: cleared the earlier attempt's records")
        print(f"plan {ctx.plan.digest()} matches; this is n{ctx.node} ({ctx.nodename})", flush=True)
        return 0
    if args.role == ROLE_EVALUATE:
        return run_evaluate(ctx)
    if args.role == ROLE_PREEMPTED:
        why = ledger.preempted_attempt(ctx.run)
        print(f"preempted: {why}" if why else f"run {ctx.run_id}: no checkpoint on SIGUSR2 in this attempt")
        return 0 if why else 1
    if args.role == ROLE_DIED:
        return run_died(ctx)
    proc = select_process(ctx, args.role)
    guard_process_group()  # what the role starts ends with it, even when it is killed outright
    result = run_process(ctx, proc)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    run_cli(main)
