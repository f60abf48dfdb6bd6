"""Each role process's record of itself, and the rules that tell a role that died from one that
left. Small file I/O and pure rules; no processes, no sockets.

    alive/<key>.json   {"key", "role", "node", "host", "pid", "left": null | "ok" | "failed" |
                        "signal <n>", "cause": null | <key>}; its mtime is the role's heartbeat
                        (touched every HEARTBEAT_S); "cause": a role whose death its watch found
                        before it failed (its failure follows from that death)
    faults/died.json   {"key", "role", "host", "how", "by"}: the first to notice a death claims it,
                       so the run says it once (`claim_death`)

A role that leaves (its work done, a failure it raised, a SIGTERM it was ended with) records how
before it closes anything a peer could see; a role killed outright (SIGKILL, the OOM killer) never
does. So a peer tells the two apart by evidence that cannot lie rather than by a clock: the role's
process is gone (the port it listened on refuses, `roles.watch`; its step ended, the batch script)
while its record says it never left. The heartbeat does not judge liveness (a starved process misses
beats: a long C call that holds the GIL, such as loading a shared library on a loaded host, stops
its heartbeat thread for seconds); it orders deaths: of the roles known to have ended, the first to
stop beating is the cause, the others (ended with it by srun) follow. A role not known to have ended
is alive however old its beat (`culprit`), and a death a role's watch found before that role failed
is named in its end record ("cause"): that death explains the failure and every death that srun
then dealt, whatever their beats say.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctoolkit.rundir.atomic import read_json, write_json_atomic

# How often a role touches its record (an mtime update: cheap on a shared filesystem).
HEARTBEAT_S = 0.25

# How a role left when it raised (`roles.heartbeat`); "ok" when it returned, "signal <n>" when ended.
FAILED = "failed"
# What a connection to a role's probe did (`roles.watch`).
ACCEPTED = "accepted"
REFUSED = "refused"
SILENT = "silent"  # timed out or unreachable: the host did not answer
# What that makes the role (`role_state`).
LIVE = "live"
LEFT = "left"
DEAD = "dead"
UNANSWERED = "unanswered"


def alive_dir(root: Path) -> Path:
    return root / "alive"


def record_path(root: Path, key: str) -> Path:
    return alive_dir(root) / f"{key}.json"


def died_path(root: Path) -> Path:
    return root / "faults" / "died.json"


@dataclass(frozen=True)
class RoleRecord:
    key: str
    role: str
    node: int
    host: str
    pid: int
    left: str | None
    beat: float  # the record's mtime
    cause: str | None = None  # the role whose death this one's failure followed from

    @classmethod
    def read(cls, path: Path) -> RoleRecord | None:
        try:
            beat = path.stat().st_mtime
        except OSError:
            return None
        rec = read_json(path)
        if not isinstance(rec, dict):
            return None
        try:
            return cls(
                str(rec["key"]),
                str(rec["role"]),
                int(rec["node"]),
                str(rec["host"]),
                int(rec["pid"]),
                None if rec.get("left") is None else str(rec["left"]),
                beat,
                None if rec.get("cause") is None else str(rec["cause"]),
            )
        except (KeyError, TypeError, ValueError):
            return None


def write_record(
    root: Path,
    key: str,
    role: str,
    node: int,
    host: str,
    pid: int,
    left: str | None,
    cause: str | None = None,
) -> Path:
    path = record_path(root, key)
    body = {"key": key, "role": role, "node": node, "host": host, "pid": pid, "left": left, "cause": cause}
    return write_json_atomic(path, body)


def beat(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)


def read_records(root: Path, keys: Iterable[str]) -> dict[str, RoleRecord | None]:
    return {k: RoleRecord.read(record_path(root, k)) for k in keys}


def role_state(connect: str, record: RoleRecord | None) -> str:
    """The watch's liveness rule for one role process, from a connection to its probe and its
    record: it answers -> live; it recorded how it left -> left (a clean exit closes the probe after
    the record, so a refusal then is no death); refused while the record says it never left ->
    dead (its host answers, its process is gone); no answer at all -> unanswered (the host is the
    question: `roles.watch` counts rounds before it calls the host lost)."""
    if connect == ACCEPTED:
        return LIVE
    if record is not None and record.left is not None:
        return LEFT
    if connect == REFUSED:
        return DEAD
    return UNANSWERED


def _never_left(rec: RoleRecord | None) -> bool:
    return rec is None or rec.left is None


def causes(records: Mapping[str, RoleRecord | None]) -> set[str]:
    """The roles that the failed roles of `records` name as the death they failed of."""
    return {r.cause for r in records.values() if r is not None and r.left == FAILED and r.cause}


def culprit(
    records: Mapping[str, RoleRecord | None],
    ended: Collection[str] | None = None,
    missing_died: bool = False,
) -> str | None:
    """Which role's end came first, when that end was a death. `records`: key -> record (None: it
    never wrote one); `ended`: the keys whose process is known gone (a step that exited, a probe
    that refuses; all of `records` when None). Pure: records in, verdict out.

    A role whose record says it never left died at its last heartbeat, but only when it is known
    gone: a live role that misses beats (starved) is no death, however old its beat. One that never
    wrote a record died first only with `missing_died` (a signal ended its step). A role that
    failed (and said so) ended at its record's last write; one that failed of a death its watch
    found names it (its "cause"), which makes that death known (its watch saw the process gone),
    and the failure no cause of its own. A death so named explains the failures and the deaths
    that followed it (srun ending their steps; a starved role's beat may be older than the death
    it followed): when any is named, only named deaths and unexplained failures are ordered.
    Those that left well or were ended (a signal) are no cause. None when no role ended, or the
    first to end failed with its own error line (the roles ended with it by srun,
    --kill-on-bad-exit, then look dead, but are not the cause)."""
    gone = set(records) if ended is None else set(ended)
    # A named death whose record says the role left after all (failed, a signal) is no death.
    named = {c for c in causes(records) if c in records and _never_left(records[c])}
    deaths = named or gone
    events: list[tuple[float, str, bool]] = []
    for key, rec in records.items():
        if rec is None:
            if key in deaths and (missing_died or key in named):
                events.append((float("-inf"), key, True))
        elif rec.left is None:
            if key in deaths:
                events.append((rec.beat, key, True))
        elif rec.left == FAILED and rec.cause not in named:
            events.append((rec.beat, key, False))
    if not events:
        return None
    _, key, died = min(events)
    return key if died else None


def died_line(role: str, host: str, how: str) -> str:
    """The one line a run that lost a role says."""
    return f"{role} (node {host}) died ({how})"


def claim_death(root: Path, key: str, role: str, host: str, how: str, by: str) -> bool:
    """Record that role `key` died, unless someone did already: True for the first claimant only,
    who then says the run's one line."""
    path = died_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"key": key, "role": role, "host": host, "how": how, "by": by, "at": time.time()}
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump(body, f)
    return True


def announce_once(root: Path) -> bool:
    """True for the first caller only: the batch script says the run's died line once, however many
    of its failed steps ask (`roles.verdict`)."""
    try:
        os.close(os.open(died_path(root).with_suffix(".said"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


def claimed(root: Path) -> dict[str, Any] | None:
    rec = read_json(died_path(root))
    return rec if isinstance(rec, dict) else None
