"""The draft registry: JSON `architectures[0]` / `model_type` -> config class -> model class.

Lookups are exact. A config is matched by its first architecture, then by `model_type`; a model
by the config's exact type, so `K3DSparkConfig` builds `K3DSparkModel` even though it is also a
`DSparkConfig`. Names that vLLM writes into served checkpoints are registered too, so an
exported `config.json` resolves back to the class that produced it.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.config import DraftConfig
from hpctoolkit.models.dflash import DFlashConfig, DFlashDraftModel
from hpctoolkit.models.dspark import DSparkConfig, DSparkDraftModel
from hpctoolkit.models.eagle3 import Eagle3Config, Eagle3DraftModel
from hpctoolkit.models.k3_dspark import K3DSparkConfig, K3DSparkModel

_CONFIG_BY_NAME: dict[str, type[DraftConfig]] = {}
_MODEL_BY_CONFIG: dict[type[DraftConfig], type[nn.Module]] = {}
_ARCH_BY_CONFIG: dict[type[DraftConfig], str] = {}


def register_draft(
    config_cls: type[DraftConfig],
    model_cls: type[nn.Module],
    *,
    architectures: tuple[str, ...],
) -> None:
    """Register a draft under its architecture names and its config's `model_type`; duplicates raise."""
    names = (*architectures, config_cls.model_type)
    for name in names:
        if name in _CONFIG_BY_NAME:
            raise ConfigError(
                f"draft name {name!r} is already registered to {_CONFIG_BY_NAME[name].__name__}"
            )
    if config_cls in _MODEL_BY_CONFIG:
        raise ConfigError(
            f"{config_cls.__name__} is already registered to {_MODEL_BY_CONFIG[config_cls].__name__}"
        )
    for name in names:
        _CONFIG_BY_NAME[name] = config_cls
    _MODEL_BY_CONFIG[config_cls] = model_cls
    _ARCH_BY_CONFIG[config_cls] = architectures[0]


def architecture_for(config: DraftConfig) -> str:
    """The first architecture name registered for this config type (what `save_draft` writes)."""
    model_class_for(config)
    return _ARCH_BY_CONFIG[type(config)]


def known_names() -> list[str]:
    return sorted(_CONFIG_BY_NAME)


def config_class_for(config_dict: Mapping[str, Any]) -> type[DraftConfig]:
    archs = config_dict.get("architectures") or []
    keys = [*archs[:1], config_dict.get("model_type")]
    for key in keys:
        if key in _CONFIG_BY_NAME:
            return _CONFIG_BY_NAME[key]
    raise ConfigError(
        f"no draft registered for architectures={archs!r} / model_type={config_dict.get('model_type')!r}; "
        f"known: {', '.join(known_names())}"
    )


def model_class_for(config: DraftConfig) -> type[nn.Module]:
    try:
        return _MODEL_BY_CONFIG[type(config)]
    except KeyError:
        known = ", ".join(sorted(c.__name__ for c in _MODEL_BY_CONFIG))
        raise ConfigError(f"no draft model registered for {type(config).__name__}; known: {known}") from None


def config_from_dict(config_dict: Mapping[str, Any]) -> DraftConfig:
    data = dict(config_dict)
    cls = config_class_for(data)
    data.pop("model_type", None)
    return cls(**data)


def load_draft_config(path: str | Path) -> DraftConfig:
    """Read a draft `config.json` (or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"draft config {path} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"draft config {path} is not valid JSON: {exc}") from None
    return config_from_dict(data)


def build_draft_model(config: DraftConfig, *, device: str | torch.device | None = None) -> nn.Module:
    """Instantiate the registered model; `device="meta"` allocates nothing."""
    cls = model_class_for(config)
    if device is None:
        return cls(config)
    with torch.device(device):
        return cls(config)


register_draft(Eagle3Config, Eagle3DraftModel, architectures=("Eagle3DraftModel", "Eagle3Qwen3ForCausalLM"))
register_draft(DFlashConfig, DFlashDraftModel, architectures=("DFlashDraftModel",))
register_draft(DSparkConfig, DSparkDraftModel, architectures=("Qwen3DSparkModel",))
register_draft(K3DSparkConfig, K3DSparkModel, architectures=("K3DSparkModel",))
