"""The one place in the package that runs a one-shot command (`sbatch`, `scontrol`, `sacct`, ...).

Long-lived services (the Mooncake master, vLLM) are started with `Popen` by the modules that own
them; everything that runs to completion and returns text comes through `run`.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence


class CommandError(RuntimeError):
    """A command exited non-zero or could not start. The message names the command and its stderr."""

    def __init__(self, cmd: Sequence[str], returncode: int, stderr: str) -> None:
        self.cmd = list(cmd)
        self.returncode = returncode
        self.stderr = stderr
        tail = stderr.strip().splitlines()[-1] if stderr.strip() else "(no stderr)"
        super().__init__(f"{' '.join(self.cmd)} exited {returncode}: {tail}")


def run(
    cmd: Sequence[str],
    *,
    stdin: str | None = None,
    cwd: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> str:
    """Run `cmd` to completion and return its stdout; raise `CommandError` on failure."""
    try:
        proc = subprocess.run(
            list(cmd),
            input=stdin,
            cwd=cwd,
            env=None if env is None else dict(env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except FileNotFoundError:
        raise CommandError(cmd, 127, f"{cmd[0]}: command not found") from None
    except subprocess.TimeoutExpired:
        raise CommandError(cmd, 124, f"timed out after {timeout_s:.0f}s") from None
    if proc.returncode != 0:
        raise CommandError(cmd, proc.returncode, proc.stderr)
    return proc.stdout
