"""What a role prints for people: `[hpctoolkit.<role>] message` lines, one home for their form.

The embedded launcher (`roles.local`) copies every line that starts with `[hpctoolkit` from a
role's log to the console; a batch job's per-role logs hold the same lines.

A progress line is one whose message starts with a count, `<what> k/n` (the trainer's
`step 40/800, loss ...`, evaluate's `questions 3/8`; `rundir.progress` forms them). On a terminal
the launcher redraws the latest one in place, so each phase keeps one live status line, and any
other line ends it where it stands; elsewhere (a Slurm log, CI, a pipe) every line is a plain line.
The live line is written whole, newline included, and the next one first moves up over it: the
cursor is always at a line's start, so whatever else reaches the terminal (an error on stderr at
the end) starts on a line of its own.
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Callable
from typing import TextIO

PROGRESS = re.compile(r"^\[hpctoolkit[^\]]*\] [a-z][a-z ]*? \d+/\d+\b")


def tag(role: str | None) -> str:
    """The prefix of a role's progress lines; the launcher's own have no role."""
    return "[hpctoolkit]" if not role else f"[hpctoolkit.{role}]"


def is_progress(line: str) -> bool:
    """Whether `line` (a whole `[hpctoolkit...] message` line) is a progress line."""
    return PROGRESS.match(line) is not None


class Console:
    """The launcher's terminal: plain lines, and on a TTY one live line redrawn in place.

    Role lines arrive from one copying thread per role, the launcher's own from its main thread:
    one lock keeps a line whole and the live line's state consistent."""

    def __init__(self, out: TextIO | None = None, live: bool | None = None):
        self._out = out
        self._live = live
        self._lock = threading.Lock()
        self._pending = False  # the line above the cursor is a live line

    @property
    def out(self) -> TextIO:
        return self._out if self._out is not None else sys.stdout

    def live(self) -> bool:
        if self._live is not None:
            return self._live
        isatty = getattr(self.out, "isatty", None)
        return bool(isatty and isatty())

    def line(self, text: str, *, progress: bool = False) -> None:
        with self._lock:
            if progress and self.live():
                self.out.write(("\x1b[1A\x1b[2K" if self._pending else "") + text + "\n")
                self._pending = True
            else:
                # A live line stays as the phase's last word; the new line goes below it.
                self.out.write(text + "\n")
                self._pending = False
            self.out.flush()


CONSOLE = Console()


def speaker(role: str | None = None) -> Callable[[str], None]:
    """`say(msg)` for `role`: one flushed line, so a launcher copying the log sees it at once."""
    prefix = tag(role)

    def say(msg: str) -> None:
        CONSOLE.line(f"{prefix} {msg}")

    return say


def echo(name: str, line: str) -> None:
    """A role's progress line, copied from its log to the launcher's console as `name | line`;
    a progress line is redrawn in place on a terminal."""
    text = line.rstrip()
    CONSOLE.line(f"{name:>9} | {text}", progress=is_progress(text))
