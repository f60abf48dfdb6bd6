"""What a role prints for people: `[hpctoolkit.<role>] message` lines, one home for their form.

The embedded launcher (`roles.local`) copies every line that starts with `[hpctoolkit` from a
role's log to the console; a batch job's per-role logs hold the same lines.
"""

from __future__ import annotations

from collections.abc import Callable


def tag(role: str | None) -> str:
    """The prefix of a role's progress lines; the launcher's own have no role."""
    return "[hpctoolkit]" if not role else f"[hpctoolkit.{role}]"


def speaker(role: str | None = None) -> Callable[[str], None]:
    """`say(msg)` for `role`: one flushed line, so a launcher copying the log sees it at once."""
    prefix = tag(role)

    def say(msg: str) -> None:
        print(f"{prefix} {msg}", flush=True)

    return say


def echo(name: str, line: str) -> None:
    """A role's progress line, copied from its log to the launcher's console as `name | line`."""
    print(f"{name:>9} | {line.rstrip()}", flush=True)
