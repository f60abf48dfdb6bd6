"""The phases of a run, in order: the one description that the embedded launcher executes
(`roles.local`), the batch-script renderer renders (`slurm.render`) and each submitit task follows
(`roles.dispatch`). Pure: names, order, conditions and bounds; no processes.

    start -> master -> engines -> trainers -> drain -> evaluate -> stop -> end

A phase is entered when its condition holds for what the run has seen so far (`Seen`): the master
is skipped with an external master; evaluate runs only when enabled and the run is clean (the
trainers exited 0 and no SIGUSR2 came: the time limit is near, so the engines are not waited for
either). The trainers' status decides the run (`outcome`); a failed evaluate fails a clean run.
`walk` is the whole path for given statuses: what the tests (and every backend's) compare against.

One driver walks the phases (`drive`); each backend is a table of hooks, one per phase name
(`Hooks`): the embedded launcher's run its processes (`roles.local`), a submitit task's run its own
part (`roles.dispatch`), the batch script's emit the statements that run them (`slurm.render`).
`python -m hpctoolkit.status` reads the same phases to say where a run is. Adding a phase is a
`Phase` here plus its hook in each table: a table without it (or with a name that is no phase)
is refused before anything runs (`check_hooks`).

The watch: from the engines phase until the trainers end, every started role is watched. One that
dies (SIGKILL, the OOM killer: no end record) or fails ends the run within `DEATH_BOUND_S`, its
peers ended, with one line naming it (`role_label`): the batch script watches its steps
(`WATCH_POLL_S`), the embedded launcher its processes (`EMBEDDED_POLL_S`), submitit's one step
ends on a bad exit (`srun --kill-on-bad-exit`), and on several hosts each role also watches the
others' processes (`roles.watch`). Each role process keeps a record of itself that says whether it left and how
(`rundir.alive`); a role whose record says it did not leave, and whose process is gone, died.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hpctoolkit.plan.placement import (
    ROLE_ENGINE_FOLLOWER,
    ROLE_ENGINE_LEADER,
    ROLE_EVALUATE,
    ROLE_MASTER,
    ROLE_TRAINER,
    Plan,
    Process,
)
from hpctoolkit.rundir.ledger import PREEMPTED_EXIT

# After the trainers exit 0, how long the engines get to leave by themselves (they notice the
# drained marker, close their store segments and stop vLLM) before they are ended. One value for
# every backend: an engine's own shutdown is bounded at ~45 s (vLLM's, then ours:
# `CaptureEngine.shutdown`), a headless follower notices its leader left within its 2 s poll;
# 120 s leaves that more than 2x headroom for a CPU engine on a loaded machine (the old embedded
# launcher's 300 s only delayed a failure that ending the engines now avoids), while a job that
# holds every node of its allocation meanwhile does not hold them much longer than needed.
ENGINES_DRAIN_GRACE_S = 120
# The master's start-up: how long it gets, once started, to publish its record (`master.json`) and
# listen. The one bound for everyone who waits on it: the embedded launcher for the record, and each
# role, started with it (the master imports torch and spawns the binary), for the record
# (`roles.context`) and for a connection (`roles.waits`).
MASTER_START_TIMEOUT_S = 120
# Ending a role: SIGTERM, then SIGKILL after this (the embedded launcher's, a role's watch ending its
# own process group, `roles.watch`; under Slurm, srun's KillWait). The master, ended last, leaves
# within it: it only stops its store.
STOP_GRACE_S = 15
# How often the batch script looks at its steps (a whole second: `sleep` in the script).
WATCH_POLL_S = 1
# How often the embedded launcher looks at its role processes and records: they are local, a look
# costs nothing, and a short run (`make run`, the tests) ends that much sooner.
EMBEDDED_POLL_S = 0.2
# The roles' heartbeat has its one home beside the records it touches: `rundir.alive.HEARTBEAT_S`.
# From a role's death (or failure) to the job's end, every process of the job gone: the watch
# notices within WATCH_POLL_S (a peer's within `roles.watch`'s few seconds), names the role
# (a few seconds of Python start-up on a loaded node), then ends the other steps (SIGTERM, then
# SIGKILL after STOP_GRACE_S; under Slurm its KillWait), the drain skipped. Measured 4-6 s from the
# kill to Slurm's FAILED on the emulated hosts (tests/e2e/test_kill.py holds it to this bound); the
# bound leaves room for a loaded node and a role that needs its whole KillWait.
DEATH_BOUND_S = 90

# When a phase is entered (`enters`).
ALWAYS = "always"
OWN_MASTER = "the plan places a master (skipped with store.master_address)"
STARTED = "the earlier phases started"
CLEAN_AND_ENABLED = "evaluate.enabled, the trainers exited 0 and no SIGUSR2 came"


def role_key(proc: Process) -> str:
    """A role process's name in the run's records (`rundir.alive`) and, but for the trainers (one
    step of all ranks), the batch script's step: master, engine<i>-<node_rank>, trainer<rank>."""
    if proc.role in (ROLE_ENGINE_LEADER, ROLE_ENGINE_FOLLOWER):
        return f"engine{proc.engine}-{proc.node_rank}"
    if proc.role == ROLE_TRAINER:
        return f"trainer{proc.node_rank}"
    return proc.role


def role_label(proc: Process) -> str:
    """How the one line of a run that lost a role names it."""
    if proc.role == ROLE_ENGINE_LEADER:
        return f"engine {proc.engine} leader"
    if proc.role == ROLE_ENGINE_FOLLOWER:
        return f"engine {proc.engine} follower (node_rank {proc.node_rank})"
    if proc.role == ROLE_TRAINER:
        return f"trainer rank {proc.node_rank}"
    return proc.role


TRAINER_STEP = "trainer"


def step_processes(plan: Plan, step: str) -> tuple[Process, ...]:
    """The processes of the batch script's step `step` (its srun --job-name): every trainer rank
    for the trainers' step, else the one process whose `role_key` it is."""
    procs = plan.processes()
    if step == TRAINER_STEP:
        return tuple(p for p in procs if p.role == ROLE_TRAINER)
    return tuple(p for p in procs if p.role != ROLE_TRAINER and role_key(p) == step)


def how_ended(status: int) -> str:
    """A step's or process's exit status in words: a status above 128 is the shell's and srun's
    way to say a signal ended it (a negative one, Popen's)."""
    if status < 0:
        return f"signal {-status}"
    if status > 128:
        return f"signal {status - 128}"
    return f"exit status {status}"


@dataclass(frozen=True)
class Phase:
    name: str
    what: str
    # The roles this phase starts (`starts`) or ends (`ends`).
    starts: tuple[str, ...] = ()
    ends: tuple[str, ...] = ()
    enter: str = ALWAYS
    # The launcher's wait in this phase, seconds; None: unbounded (the roles bound their own).
    bound_s: int | None = None


PHASES: tuple[Phase, ...] = (
    Phase("start", "attempt start: the run directory, its config.yaml, an earlier attempt's records cleared"),
    Phase(
        "master",
        "the Mooncake master is up (skipped with an external master)",
        starts=(ROLE_MASTER,),
        enter=OWN_MASTER,
        bound_s=MASTER_START_TIMEOUT_S,
    ),
    Phase(
        "engines",
        "engine leaders and headless followers capture and publish",
        starts=(ROLE_ENGINE_LEADER, ROLE_ENGINE_FOLLOWER),
        enter=STARTED,
    ),
    Phase(
        "trainers",
        "the trainers read, train and export; the run's outcome is theirs",
        starts=(ROLE_TRAINER,),
        enter=STARTED,
    ),
    Phase(
        "drain",
        "the engines leave by themselves once drained, within one grace (a clean run), else are ended",
        ends=(ROLE_ENGINE_LEADER, ROLE_ENGINE_FOLLOWER),
        bound_s=ENGINES_DRAIN_GRACE_S,
    ),
    Phase(
        "evaluate",
        "serve the export and merge the figures (evaluate.enabled, a clean run)",
        starts=(ROLE_EVALUATE,),
        enter=CLEAN_AND_ENABLED,
    ),
    Phase(
        "stop",
        "the master last, after every engine unmounted its segments",
        ends=(ROLE_MASTER,),
        bound_s=STOP_GRACE_S,
    ),
    Phase("end", "the end records and summary.json; a preempted Slurm job requeues"),
)
PHASE_NAMES: tuple[str, ...] = tuple(p.name for p in PHASES)
BY_NAME: dict[str, Phase] = {p.name: p for p in PHASES}

# The run's outcome (`Outcome.kind`).
OK = "ok"
FAILED = "failed"
PREEMPTED = "preempted"


@dataclass(frozen=True)
class RunShape:
    """What the path through the phases depends on before the run starts."""

    own_master: bool
    evaluate: bool

    @classmethod
    def of(cls, plan: Plan, evaluate_enabled: bool) -> RunShape:
        return cls(own_master=plan.master is not None, evaluate=bool(evaluate_enabled))


@dataclass(frozen=True)
class Seen:
    """What the run has seen so far: the trainers' status (None: still running), whether SIGUSR2
    came (the time limit is near), and whether the run's records show a checkpoint written on it."""

    trainers_rc: int | None = None
    late: bool = False
    checkpointed: bool = False

    @property
    def clean(self) -> bool:
        return self.trainers_rc == 0 and not self.late

    @property
    def preempted(self) -> bool:
        rc = self.trainers_rc
        return rc == PREEMPTED_EXIT or (rc not in (None, 0) and self.checkpointed)


@dataclass(frozen=True)
class Outcome:
    kind: str  # OK, FAILED or PREEMPTED
    # The phase whose status decided a failure ("trainers" or "evaluate"); None otherwise.
    failed: str | None
    # The batch job's exit status (a requeued job exits 0: its next attempt carries on).
    code: int
    requeue: bool


def enters(name: str, shape: RunShape, seen: Seen) -> bool:
    """Whether the run enters phase `name`, given what it has seen (phases come in `PHASES` order;
    evaluate is decided once the trainers have ended)."""
    return enters_phase(BY_NAME[name], shape, seen)


def enters_phase(phase: Phase, shape: RunShape, seen: Seen) -> bool:
    cond = phase.enter
    if cond == OWN_MASTER:
        return shape.own_master
    if cond == CLEAN_AND_ENABLED:
        return shape.evaluate and seen.clean
    return True


def bound_s(name: str, seen: Seen) -> int | None:
    """The launcher's wait in phase `name`. The drain waits for the engines only after a clean
    run; otherwise they are ended at once (failed: nothing to finish; late: no time to)."""
    if name == "drain" and not seen.clean:
        return 0
    return BY_NAME[name].bound_s


def outcome(seen: Seen, evaluate_rc: int | None = None) -> Outcome:
    """The run's outcome from the trainers' status and, after a clean run, evaluate's."""
    rc = seen.trainers_rc
    if rc is None:
        raise ValueError("no outcome before the trainers ended")
    if seen.preempted:
        return Outcome(PREEMPTED, None, 0, requeue=True)
    if rc != 0:
        return Outcome(FAILED, "trainers", rc, requeue=False)
    if evaluate_rc is not None and evaluate_rc != 0:
        return Outcome(FAILED, "evaluate", evaluate_rc, requeue=False)
    return Outcome(OK, None, 0, requeue=False)


def walk(shape: RunShape, seen: Seen, evaluate_rc: int | None = 0) -> tuple[tuple[str, ...], Outcome]:
    """The phases a run enters, in order, once the trainers ended as `seen` says; and its outcome."""
    names = tuple(n for n in PHASE_NAMES if enters(n, shape, seen))
    return names, outcome(seen, evaluate_rc if "evaluate" in names else None)


def roles_started(names: tuple[str, ...]) -> tuple[str, ...]:
    """The roles the phases `names` start, in order (the plan decides how many of each)."""
    return tuple(r for n in names for r in BY_NAME[n].starts)


# A backend's part in one phase, given what the run has seen so far; returns what the run has seen
# after it (the trainers' phase: their status, SIGUSR2), or None: nothing new.
Hook = Callable[[Seen], "Seen | None"]
# A backend's hooks by phase name: None where it has no part in a phase it does not leave out (a
# submitit task outside its role's phases). Every phase has an entry, every entry a phase.
Hooks = Mapping[str, Hook | None]


def check_hooks(backend: str, hooks: Mapping[str, object], phases: Sequence[Phase] | None = None) -> None:
    """Refuse a backend's table that misses a phase (of `phases`, by default `PHASES` as it is when
    called) or names one that is none: one line that says which, and where the fix goes."""
    names = [p.name for p in (PHASES if phases is None else phases)]
    missing = [n for n in names if n not in hooks]
    unknown = [n for n in hooks if n not in names]
    if missing or unknown:
        what = [f"no hook for phase(s) {', '.join(missing)}"] if missing else []
        what += [f"hooks for no phase: {', '.join(unknown)}"] if unknown else []
        raise ValueError(
            f"the {backend} backend does not match plan.lifecycle.PHASES ({' -> '.join(names)}): {'; '.join(what)}; "
            "give it one hook per phase (None where it has no part)"
        )


def drive(
    backend: str,
    hooks: Hooks,
    shape: RunShape,
    on_phase: Callable[[Phase], None] | None = None,
    *,
    seen: Seen = Seen(),
    phases: Sequence[Phase] | None = None,
) -> Seen:
    """The one walk of the lifecycle: each phase in order that the run enters (`enters`, on what it
    has seen so far) and in which the backend has a part is announced (`on_phase`), then its hook
    runs. Returns what the run saw. A hook's error ends the walk: the backend ends what it started.
    The batch script walks with `seen` a clean run's, the path that enters every phase some run may
    enter; its shell decides the rest."""
    phases = PHASES if phases is None else phases
    check_hooks(backend, hooks, phases)
    for phase in phases:
        hook = hooks[phase.name]
        if hook is None or not enters_phase(phase, shape, seen):
            continue
        if on_phase is not None:
            on_phase(phase)
        seen = hook(seen) or seen
    return seen
