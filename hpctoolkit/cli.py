"""The one place where argv is read and a `ConfigError` becomes exit code 2.

Every `python -m hpctoolkit.X` entry point is `run_cli(main)`, where `main(argv) -> int` raises
`ConfigError` for user mistakes (exit 2) and `StoreError` / `DataIntegrityError` for data-path
faults (exit 1). The user sees one line naming the key, address or sample, never a traceback.

Every entry point builds its arguments with `parser(...)` and reads them with `parse(...)`:
flags and positionals (`section.key=value` overrides included) may come in any order, and argparse
never exits on its own: a usage mistake is a `ConfigError`, `--help` is `HelpRequested`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from hpctoolkit.errors import ConfigError, DataIntegrityError, RoleFailedError, StoreError

EXIT_USAGE = 2
EXIT_FAILED = 1


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


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    try:
        code = main(args)
    except HelpRequested as shown:
        print(str(shown), end="")
        sys.exit(0)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except (StoreError, DataIntegrityError, RoleFailedError) as err:
        # A data-path fault: the run stopped rather than train on partial data. The message
        # names the store address or the sample key at fault.
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)
