"""`python -m hpctoolkit.roles died`: after a step of the batch script exited non-zero, name the
role of it that died first (`rundir.alive.culprit`) in the run's one line, or the role whose death
its roles failed of (their end records name it), or the role a peer's watch claimed first
(`rundir.alive.claim_death`); said once however many steps ask. A step whose roles all recorded how
they left failed rather than died: its own error line is the run's, and this says nothing."""

from __future__ import annotations

from hpctoolkit import envs
from hpctoolkit.errors import ConfigError
from hpctoolkit.plan import lifecycle
from hpctoolkit.roles.context import NodeContext
from hpctoolkit.rundir import alive


def name_the_dead(ctx: NodeContext, step: str, status: int) -> str | None:
    """The line naming the role of `step` that died, when this call is the first to claim it; or
    the role whose death a role of `step` failed of (its end record names it: `rundir.alive`),
    which explains the step's end."""
    procs = lifecycle.step_processes(ctx.plan, step)
    if not procs:
        raise ConfigError(f"{envs.HPCTOOLKIT_FAILED_STEP.name}={step!r} names no step of this plan")
    every = {lifecycle.role_key(p): p for p in ctx.plan.processes()}
    keys = [lifecycle.role_key(p) for p in procs]
    records = alive.read_records(ctx.run.root, keys)
    records |= alive.read_records(
        ctx.run.root, sorted(alive.causes(records) & (every.keys() - records.keys()))
    )
    # Every role of the step ended with it. One that never wrote its record died first only when a
    # signal ended the step.
    key = alive.culprit(records, ended=keys, missing_died=status > 128)
    if key is None:
        return None
    rec, proc = records[key], every[key]
    host = rec.host if rec is not None else ctx.host(proc.node)
    if key in keys:
        how = lifecycle.how_ended(status) + ("" if rec is not None else ", before it started")
    else:  # named by a role of the step, whose watch found its process gone
        how = "its process " + ("" if rec is None else f"{rec.pid} ") + "is gone, no end record"
    label = lifecycle.role_label(proc)
    if not alive.claim_death(ctx.run.root, key, label, host, how, by="the batch script"):
        return None
    return alive.died_line(label, host, how)


def run_died(ctx: NodeContext) -> int:
    step = envs.get(envs.HPCTOOLKIT_FAILED_STEP.name) or ""
    try:
        status = int(envs.get(envs.HPCTOOLKIT_FAILED_STATUS.name) or "0")
    except ValueError:
        raise ConfigError(f"{envs.HPCTOOLKIT_FAILED_STATUS.name} is not an exit status") from None
    root = ctx.run.root
    line = name_the_dead(ctx, step, status)
    claim = alive.claimed(root)
    if line is None and claim is not None:
        # A peer's watch claimed the death first. Its own line may never reach the job's output
        # (srun ends that role's step while it unwinds), so the batch script, which outlives every
        # step, says the run's one line from the claim.
        line = alive.died_line(str(claim.get("role")), str(claim.get("host")), str(claim.get("how")))
    if line and alive.announce_once(root):
        print(f"hpctoolkit: {line}", flush=True)
    return 0 if line or claim else 1
