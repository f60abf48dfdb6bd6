"""`python -m hpctoolkit.status RUN_DIR`: where a run is, from its run directory's records alone.

RUN_DIR is a run's directory, the `latest` link, or a recipe's `paths.output_dir` (its newest run,
which `latest` names only once that run finished). It works on any backend and while the run goes
on: the roles write every record atomically (`rundir.atomic`), so a reader sees whole ones.

The phase is the first of `plan.lifecycle.PHASES` that the run enters (`lifecycle.enters_phase`)
whose records are not all there yet (`RECORDED`, one entry a phase):

    start     until a role leaves any record (config.yaml, inputs.json and attempt.json are the
              start's own)
    master    master.json (skipped with an external master, `store.master_address`)
    engines   until the trainers report a step (`progress/trainer.json`, `train/data_order/rank0.jsonl`)
    trainers  until `ended.json`
    drain     until every engine's `manifests/engine<i>.closed`
    evaluate  until `evaluate.json` (only with `evaluate.enabled`)
    stop      until the launcher's `wall_seconds` in summary.json (the embedded run only)
    end       summary.json and all of the above

A failure is what a role left: `ended.json` with `ok: false` (the trainers; `preempted` when a
SIGUSR2 checkpointed them), an engine's `manifests/engine<i>.failed`, a role's `error: ...` line as
the last line of its log (`logs/<role>.log`, the embedded run's). The report then names the phase
and the role where the run stopped. It also lists where this run's listeners listen: the master's
addresses (`master.json`) and the ports picked at start (`ports/<listener>.json`, `plan.ports`). `read_records` is the only I/O; `report` is pure.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpctoolkit.cli import parse, parser, run_cli
from hpctoolkit.errors import ConfigError
from hpctoolkit.output.figures import duration, figure, seconds
from hpctoolkit.plan import lifecycle
from hpctoolkit.plan.lifecycle import RunShape, Seen
from hpctoolkit.rundir.atomic import read_json
from hpctoolkit.rundir.layout import LATEST, RunDir
from hpctoolkit.rundir.progress import DEFAULT_EVERY_S, count_line, trainer_progress_line

RUNNING, DONE, FAILED, PREEMPTED = "running", "done", "failed", "preempted"
# A trainer silent for this many of its reporting intervals may be gone (a killed job leaves no record).
SILENT_INTERVALS = 10


@dataclass(frozen=True)
class Records:
    """What a run directory holds, as read at one moment (`read_records`)."""

    run: RunDir
    config: dict[str, Any]
    master: dict[str, Any] | None = None
    published: dict[int, int] = field(default_factory=dict)  # engine -> manifest lines so far
    engines_done: dict[int, dict[str, Any]] = field(default_factory=dict)
    engines_failed: dict[int, dict[str, Any]] = field(default_factory=dict)
    engines_closed: frozenset[int] = frozenset()
    drained: bool = False
    trainer: dict[str, Any] | None = None  # progress/trainer.json
    steps_logged: int = 0  # lines of train/data_order/rank0.jsonl
    ended: dict[str, Any] | None = None
    evaluation: dict[str, Any] | None = None  # evaluate.json
    evaluate_progress: dict[str, Any] | None = None
    summary: dict[str, Any] | None = None
    attempt: dict[str, Any] | None = None
    role_errors: dict[str, tuple[float, str]] = field(default_factory=dict)  # role -> (mtime, line)
    ports: dict[str, str] = field(default_factory=dict)  # listener -> address:port (ports/*.json)
    started: bool = True  # anything in the run directory but the start's own records


@dataclass(frozen=True)
class Report:
    phase: str
    state: str  # RUNNING | DONE | FAILED | PREEMPTED
    role: str | None  # where a failed run stopped
    lines: list[str]


def _section(cfg: dict[str, Any], name: str) -> dict[str, Any]:
    value = cfg.get(name)
    return value if isinstance(value, dict) else {}


def _engines(cfg: dict[str, Any]) -> int:
    return int(_section(cfg, "engine").get("num_engines") or 1)


def _external(r: Records) -> bool:
    return bool(_section(r.config, "store").get("master_address"))


def _stopped(r: Records) -> bool:
    local = _section(r.config, "cluster").get("backend") == "local"
    return r.summary is not None and (not local or "wall_seconds" in r.summary)


# When each phase's records are all there (the module docstring's table), by `PHASES` name; the
# run rests in the end.
RECORDED: dict[str, Callable[[Records], bool]] = {
    "start": lambda r: r.started,
    "master": lambda r: r.master is not None or r.ended is not None,
    "engines": lambda r: r.ended is not None or r.trainer is not None or bool(r.steps_logged),
    "trainers": lambda r: r.ended is not None and bool(r.ended.get("ok")),
    "drain": lambda r: len(r.engines_closed) >= _engines(r.config),
    "evaluate": lambda r: r.evaluation is not None,
    "stop": _stopped,
    "end": lambda r: False,
}


def _phase(r: Records) -> str:
    """The first phase the run enters whose records are not all there (`RECORDED`)."""
    phases = lifecycle.PHASES
    lifecycle.check_hooks("status", RECORDED, phases)
    shape = RunShape(
        own_master=not _external(r), evaluate=bool(_section(r.config, "evaluate").get("enabled", True))
    )
    # Evaluate is looked at only once the trainers ended well.
    seen = Seen(trainers_rc=0 if r.ended is not None and r.ended.get("ok") else None)
    for phase in phases:
        if lifecycle.enters_phase(phase, shape, seen) and not RECORDED[phase.name](r):
            return phase.name
    return phases[-1].name


def _failure(r: Records) -> tuple[str, str, str] | None:
    """(state, role, what) of a run that stopped: the earliest failure a role left."""
    if r.ended is not None and r.ended.get("preempted"):
        return (
            PREEMPTED,
            "trainer0",
            f"checkpointed at step {r.ended.get('step')} on SIGUSR2; requeue to resume",
        )
    found: list[tuple[float, str, str]] = []
    for engine, rec in r.engines_failed.items():
        found.append((float(rec.get("time", 0.0)), f"engine{engine}", str(rec.get("error", "failed"))))
    for role, (mtime, line) in r.role_errors.items():
        found.append((mtime, role, line.removeprefix("error: ")))
    if found:
        _, role, what = min(found)
        return FAILED, role, what
    if r.ended is not None and not r.ended.get("ok"):
        return FAILED, "trainer0", str(r.ended.get("error", "ended.json says ok: false"))
    return None


def _trainer_progress_line(r: Records, now: float) -> str | None:
    p = r.trainer
    total = _section(r.config, "training").get("steps")
    if p is None:
        return f"step {r.steps_logged}/{total} (no progress record yet)" if r.steps_logged else None
    if r.ended is not None:
        return trainer_progress_line(p)
    age = now - float(p.get("time", now))
    line = f"{trainer_progress_line(p)}; reported {duration(age)} ago"
    every = _section(r.config, "training").get("progress_every_s") or DEFAULT_EVERY_S
    if age > SILENT_INTERVALS * float(every):
        line += f" (nothing for {SILENT_INTERVALS} intervals of {seconds(every)}: is the job still running?)"
    return line


def _engine_line(r: Records) -> str | None:
    n = _engines(r.config)
    if not r.published and not r.engines_done:
        return None
    published = sum(
        r.engines_done[e].get("published", 0) if e in r.engines_done else r.published.get(e, 0)
        for e in range(n)
    )
    samples = _section(r.config, "data").get("num_samples")
    done = len(r.engines_done)
    line = f"{published} of {samples} samples published; {done}/{n} engine(s) done capturing"
    if r.engines_closed:
        line += f", {len(r.engines_closed)}/{n} closed"
    return line + ("; the trainers read every share (drained)" if r.drained else "")


def _evaluate_line(r: Records) -> str | None:
    if r.evaluation is not None:
        ev = r.evaluation
        return (
            f"served acceptance length {figure(ev.get('served_acceptance_length'))} on {ev.get('eval_set')}"
        )
    p = r.evaluate_progress
    if p is None:
        return None
    return count_line(p)


def _end_line(s: dict[str, Any]) -> str:
    parts = []
    if "wall_seconds" in s:
        parts.append(f"done in {seconds(s['wall_seconds'])}")
    parts.append(f"{s.get('steps_trained')} steps, final loss {figure(s.get('final_loss'))}")
    parts.append(f"trainer acceptance length {figure(s.get('acceptance_length'))}")
    if s.get("served_acceptance_length") is not None:
        parts.append(f"served {figure(s.get('served_acceptance_length'))} at k={s.get('served_k')}")
    return "; ".join(parts)


def report(r: Records, now: float) -> Report:
    """The run's phase, state and a few lines for people, from `r` alone (pure)."""
    phase = _phase(r)
    failure = _failure(r)
    state, role = RUNNING, None
    trail = " > ".join(f"[{p.name}]" if p.name == phase else p.name for p in lifecycle.PHASES)
    lines = [f"run      {r.run.run_id} ({_section(r.config, 'cluster').get('backend', '?')}) in {r.run.root}"]
    if r.attempt and r.attempt.get("restart"):
        lines.append(
            f"attempt  {r.attempt.get('restart')} of job {r.attempt.get('job_id')} (resumed at step {r.attempt.get('resume_step')})"
        )
    if failure is not None:
        state, role, what = failure
        lines.append(f"phase    {phase}: {state.upper()} in {role}: {what}")
    elif phase == "end":
        state = DONE
        lines.append(f"phase    end: {_end_line(r.summary or {})}")
    else:
        lines.append(f"phase    {phase}")
    lines.append(f"phases   {trail}")
    for name, line in (
        ("engines", _engine_line(r)),
        ("trainer", _trainer_progress_line(r, now)),
        ("evaluate", _evaluate_line(r)),
    ):
        if line:
            lines.append(f"{name:<8} {line}")
    listening = _listening(r)
    if listening:
        lines.append(f"ports    {listening}")
    if failure is not None and (r.run.logs / f"{role}.log").exists():
        lines.append(f"log      {r.run.log(str(role))}")
    return Report(phase, state, role, lines)


def _listening(r: Records) -> str:
    """Where the run's listeners listen, as recorded (the master's, then the picked ports)."""
    found = {}
    if r.master:
        found["master"] = str(r.master.get("address"))
        if r.master.get("metrics_address"):
            found["master metrics"] = str(r.master["metrics_address"])
    found.update(sorted(r.ports.items()))
    return ", ".join(f"{name} {where}" for name, where in found.items())


def _last_error(log: Path) -> tuple[float, str] | None:
    """The `error: ...` line a role's log ends with (run_cli's), and when it was written."""
    try:
        with log.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            tail = f.read().decode(errors="replace")
        mtime = log.stat().st_mtime
    except OSError:
        return None
    lines = [x.strip() for x in tail.splitlines() if x.strip()]
    if lines and lines[-1].startswith("error: "):
        return mtime, lines[-1]
    return None


def _count_lines(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(1 for x in f if x.strip())
    except OSError:
        return 0


def _dict(x: Any) -> dict[str, Any] | None:
    return x if isinstance(x, dict) else None


def read_records(run: RunDir) -> Records:
    """Every record `report` looks at (missing ones as None or empty)."""
    import yaml

    config = yaml.safe_load(run.config.read_text()) or {}
    n = _engines(config)
    failed = {e: rec for e in range(n) if (rec := _dict(read_json(run.queue_failed(e)))) is not None}
    for e, rec in failed.items():
        rec.setdefault("time", run.queue_failed(e).stat().st_mtime)
    errors = {}
    if run.logs.is_dir():
        for log in sorted(run.logs.glob("*.log")):
            found = _last_error(log)
            if found is not None:
                errors[log.stem] = found
    own = {run.config.name, run.inputs.name, run.attempt.name}
    return Records(
        run=run,
        config=config,
        master=_dict(read_json(run.master_record)),
        published={e: _count_lines(run.queue(e)) for e in range(n) if run.queue(e).exists()},
        engines_done={e: rec for e in range(n) if (rec := _dict(read_json(run.queue_done(e)))) is not None},
        engines_failed=failed,
        engines_closed=frozenset(e for e in range(n) if run.engine_closed(e).exists()),
        drained=run.drained.exists(),
        trainer=_dict(read_json(run.progress("trainer"))),
        steps_logged=_count_lines(run.train_files.order_log(0)),
        ended=_dict(read_json(run.ended)),
        evaluation=_dict(read_json(run.evaluate)),
        evaluate_progress=_dict(read_json(run.progress("evaluate"))),
        summary=_dict(read_json(run.summary)),
        attempt=_dict(read_json(run.attempt)),
        role_errors=errors,
        ports=_ports(run),
        started=any(p.name not in own for p in run.root.iterdir()),
    )


def _ports(run: RunDir) -> dict[str, str]:
    out = {}
    for path in sorted(run.ports.glob("*.json")) if run.ports.is_dir() else []:
        rec = _dict(read_json(path))
        if rec and rec.get("port"):
            out[path.stem] = f"{rec.get('address')}:{rec['port']}"
    return out


def find_run(path: str | os.PathLike) -> RunDir:
    """The run `path` names: a run directory, the `latest` link, or an output directory (its
    newest run by config.yaml); anything else is a `ConfigError`."""
    p = Path(path)
    if (p / "config.yaml").is_file():
        real = p.resolve()
        return RunDir.of(real.parent, real.name)
    if p.is_dir():
        runs = [c for c in p.iterdir() if c.name != LATEST and (c / "config.yaml").is_file()]
        if runs:
            newest = max(runs, key=lambda c: ((c / "config.yaml").stat().st_mtime, c.name))
            return RunDir.of(p, newest.name)
    what = "does not exist" if not p.exists() else "holds no config.yaml, nor any run directory that does"
    raise ConfigError(f"{path} is not a run directory: it {what}")


def build_parser():
    ap = parser("hpctoolkit.status", __doc__)
    ap.add_argument(
        "run_dir", help="a run's directory, <output_dir>/latest, or <output_dir> (its newest run)"
    )
    return ap


def main(argv: list[str]) -> int:
    args = parse(build_parser(), argv)
    run = find_run(args.run_dir)
    for line in report(read_records(run), time.time()).lines:
        print(line)
    return 0


if __name__ == "__main__":
    run_cli(main)
