"""The one place where argv is read and a failure becomes one line and an exit code.

Every `python -m hpctoolkit.X` entry point is `run_cli(main)`, where `main(argv) -> int` raises
`ConfigError` for user mistakes (exit 2) and `StoreError` / `DataIntegrityError` /
`RoleFailedError` for data-path faults and failed roles (exit 1). The user sees one line naming the
key, address or sample, never a traceback. Anything else (an `OSError`, a bug) is also one line,
`error: <Type>: <message> (traceback in <file>)`, exit 1: its traceback goes to a file under
`<cache>/errors/` (`HPCTOOLKIT_CACHE`, else ~/.cache/hpctoolkit), and also to stderr with
`HPCTOOLKIT_DEBUG=1`. Ctrl-C is `interrupted`, exit 130. SIGUSR1 prints every thread's Python stack
to stderr and goes on (`dump_stacks_on_sigusr1`; `scancel --signal=USR1 JOB` for a job that hangs).
`report` is the same line for the one entry that bypasses `run_cli` (submitit's task,
`roles.dispatch.run_task`). A role process of the embedded launcher also gets its failure as a
record (`HPCTOOLKIT_FAILURE_RECORD`: `{"error": class name, "message", "said": the line's text}`),
which the launcher reads instead of the role's log.

Every entry point builds its arguments with `parser(...)` and reads them with `parse(...)`:
flags and positionals (`section.key=value` overrides included) may come in any order, and argparse
never exits on its own: a usage mistake is a `ConfigError`, `--help` is `HelpRequested`.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

from hpctoolkit import envs
from hpctoolkit.errors import ConfigError, DataIntegrityError, RoleFailedError, StoreError

EXIT_USAGE = 2
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
# Faults whose message names what failed: their traceback would tell the user nothing more.
KNOWN_FAULTS = (StoreError, DataIntegrityError, RoleFailedError)


class HelpRequested(Exception):  # noqa: N818 -- not an error: `--help` was asked for
    """`--help` was given: the text to print, then exit 0."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise ConfigError(f"{self.prog}: {(message or '').strip() or f'exit {status}'}")

    def print_help(self, file=None) -> None:
        raise HelpRequested(self.format_help())


def parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """An argument parser for `python -m {prog}`, described by the first line of `doc`."""
    return _Parser(
        prog=f"python -m {prog}",
        description=(doc or "").strip().splitlines()[0] if doc else None,
        exit_on_error=False,
        allow_abbrev=False,
    )


def parse(ap: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Flags and positionals in any order; every mistake is a `ConfigError` naming it."""
    try:
        return ap.parse_intermixed_args(list(argv))
    except argparse.ArgumentError as err:
        raise ConfigError(f"{ap.prog}: {err}") from None


def one_line(text: object) -> str:
    """`text` on one line (a message with newlines would break "one line per failure")."""
    return " ".join(str(text).split())


def error_log_dir() -> Path:
    """Where an unexpected failure's traceback is written: `<cache>/errors/`."""
    cache = envs.get(envs.HPCTOOLKIT_CACHE.name) or Path.home() / ".cache" / "hpctoolkit"
    return Path(cache) / "errors"


def _keep_traceback(err: BaseException) -> str:
    """Write `err`'s traceback to its own file; returns where (or how to see it)."""
    text = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    if envs.get(envs.HPCTOOLKIT_DEBUG.name) == "1":
        print(text, end="", file=sys.stderr)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    path = error_log_dir() / f"{stamp}-{os.getpid()}.log"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{' '.join(sys.argv)}\n{text}")
    except OSError:
        return f"{envs.HPCTOOLKIT_DEBUG.name}=1 prints the traceback"
    return f"traceback in {path}"


def _said(err: Exception) -> str:
    """What the one line says after `error: `."""
    if isinstance(err, ConfigError):
        return one_line(err)
    said = f"{type(err).__name__}: {one_line(err)}"
    if not isinstance(err, KNOWN_FAULTS):
        said += f" ({_keep_traceback(err)})"
    return said


def report(err: Exception, record: str | None = None) -> int:
    """Print the one line `err` reaches the user as (stderr); return its exit code. With `record`,
    also write it there as `{"error", "message", "said"}` (JSON; best effort)."""
    said = _said(err)
    print(f"error: {said}", file=sys.stderr, flush=True)
    if record:
        from hpctoolkit.rundir.atomic import write_json_atomic

        with contextlib.suppress(OSError):
            write_json_atomic(record, {"error": type(err).__name__, "message": one_line(err), "said": said})
    return EXIT_USAGE if isinstance(err, ConfigError) else EXIT_FAILED


def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 writes every thread's Python stack to stderr (the role's log); the process goes on."""
    # fd 2 itself: a replaced sys.stderr (pytest's capture, a notebook) may have no descriptor.
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__ or 2, all_threads=True)


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    # This process's own: a child it starts (vLLM's workers, evaluate's server) must not write it.
    record = os.environ.pop(envs.HPCTOOLKIT_FAILURE_RECORD.name, None)
    dump_stacks_on_sigusr1()
    try:
        code = main(args)
    except HelpRequested as shown:
        print(str(shown), end="")
        sys.exit(0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as err:  # noqa: BLE001 -- every failure reaches the user as one line
        sys.exit(report(err, record))
    sys.exit(code)
