"""The one place where argv is read and a `ConfigError` becomes exit code 2.

Every `python -m hpctoolkit.X` entry point is `run_cli(main)`, where `main(argv) -> int` raises
`ConfigError` for user mistakes (exit 2) and `StoreError` / `DataIntegrityError` for data-path
faults (exit 1). The user sees one line naming the key, address or sample, never a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn

from hpctoolkit.errors import ConfigError, DataIntegrityError, StoreError

EXIT_USAGE = 2
EXIT_FAILED = 1


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    try:
        code = main(args)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except (StoreError, DataIntegrityError) as err:
        # A data-path fault: the run stopped rather than train on partial data. The message
        # names the store address or the sample key at fault.
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code)
