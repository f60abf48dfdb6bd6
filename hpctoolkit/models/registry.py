"""The draft registry: each family's spec (`FamilySpec`), by family name: config class, model class,
trainer class (all from `models/<family>/`, or from the family it extends: K3 DSpark trains as
DSpark), and its `Serving` record (the pure half, in `families`).

A config dict is matched by its first architecture, then by `model_type`, against every name a
family's record lists (`Serving.names`), so both our checkpoints and the served `config.json`
export writes resolve back to the class that produced them. A model is found by the config's
exact type, so `K3DSparkConfig` builds `K3DSparkModel` even though it is also a `DSparkConfig`.
Registration rejects a config class already registered, a family already taken, and a config
class whose `model_type` has no record in `models.families`; a miss lists the valid names.

Families register from below: each trainer is declared against `models.common.trainer` (the
hooks, the batch they read, the `LossParts` they return), and this module ties it to its config,
model and record. `train/` only looks families up here (`train.build`, the loop), and nothing in
`models/` imports `train/`, so the dependency runs one way. The registrations stay in this one
module, not in each family's package init, so that those inits import nothing and the recipe
loader can ask `families` about a draft without loading torch.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.config import DraftConfig
from hpctoolkit.models.common.draft import DraftModel
from hpctoolkit.models.common.trainer import FamilyTrainer
from hpctoolkit.models.dflash.config import DFlashConfig
from hpctoolkit.models.dflash.model import DFlashDraftModel
from hpctoolkit.models.dflash.trainer import DFlashTrainer
from hpctoolkit.models.dspark.config import DSparkConfig
from hpctoolkit.models.dspark.model import DSparkDraftModel
from hpctoolkit.models.dspark.trainer import DSparkTrainer
from hpctoolkit.models.eagle3.config import Eagle3Config
from hpctoolkit.models.eagle3.model import Eagle3DraftModel
from hpctoolkit.models.eagle3.trainer import Eagle3Trainer
from hpctoolkit.models.families import families, read_config_json, serving_for
from hpctoolkit.models.k3_dspark.config import K3DSparkConfig
from hpctoolkit.models.k3_dspark.model import K3DSparkModel
from hpctoolkit.models.serving import Serving


@dataclass(frozen=True)
class FamilySpec:
    """One draft family's spec, what `train/` and evaluation look up by family: its config and
    model classes, its trainer (the hooks declared against `models.common.trainer`, whose `forward`
    calls the family's loss) and its serving record (what export writes and vLLM serves)."""

    config_cls: type[DraftConfig]
    model_cls: type[DraftModel]
    trainer_cls: type[FamilyTrainer]
    serving: Serving


_FAMILIES: dict[str, FamilySpec] = {}
_FAMILY_BY_CONFIG: dict[type[DraftConfig], str] = {}


def register_draft(
    config_cls: type[DraftConfig], model_cls: type[DraftModel], trainer_cls: type[FamilyTrainer]
) -> None:
    """Tie a config class, its model class and its trainer class to the family record of the
    config's `model_type`."""
    serving = serving_for(config_cls)
    if config_cls in _FAMILY_BY_CONFIG:
        raise ConfigError(f"{config_cls.__name__} is already registered to {_FAMILY_BY_CONFIG[config_cls]!r}")
    if serving.family in _FAMILIES:
        raise ConfigError(
            f"draft family {serving.family!r} is already registered to {_FAMILIES[serving.family].config_cls.__name__}"
        )
    _FAMILIES[serving.family] = FamilySpec(config_cls, model_cls, trainer_cls, serving)
    _FAMILY_BY_CONFIG[config_cls] = serving.family


def _family_of_config(config: DraftConfig) -> FamilySpec:
    try:
        return _FAMILIES[_FAMILY_BY_CONFIG[type(config)]]
    except KeyError:
        known = ", ".join(sorted(c.__name__ for c in _FAMILY_BY_CONFIG))
        raise ConfigError(f"no draft model registered for {type(config).__name__}; known: {known}") from None


def family_of(config: DraftConfig) -> str:
    """The family name of a config instance (its exact type, which must be registered)."""
    return _family_of_config(config).serving.family


def architecture_for(config: DraftConfig) -> str:
    """The architecture name `save_draft` writes for this config type."""
    return _family_of_config(config).serving.architectures[0]


def family_parts(family: str) -> FamilySpec:
    """A family's parts by its name; a miss lists the registered families."""
    try:
        return _FAMILIES[family]
    except KeyError:
        raise ConfigError(f"no draft family {family!r}; known: {', '.join(sorted(_FAMILIES))}") from None


def config_class_for(config_dict: Mapping[str, Any]) -> type[DraftConfig]:
    family = serving_for(config_dict).family
    if family not in _FAMILIES:
        raise ConfigError(
            f"draft family {family!r} has no config class registered; known: {', '.join(families())}"
        )
    return _FAMILIES[family].config_cls


def model_class_for(config: DraftConfig) -> type[DraftModel]:
    return _family_of_config(config).model_cls


def trainer_class_for(config: DraftConfig | str) -> type[FamilyTrainer]:
    """The trainer of a draft config (by its exact type's family) or of a family name."""
    return (
        family_parts(config).trainer_cls if isinstance(config, str) else _family_of_config(config).trainer_cls
    )


def config_from_dict(config_dict: Mapping[str, Any]) -> DraftConfig:
    data = dict(config_dict)
    cls = config_class_for(data)
    data.pop("model_type", None)
    return cls(**data)


def load_draft_config(path: str | os.PathLike) -> DraftConfig:
    """Read a draft `config.json` (or a directory holding one)."""
    return config_from_dict(read_config_json(path))


def build_draft_model(config: DraftConfig, *, device: str | torch.device | None = None) -> DraftModel:
    """Instantiate the registered model; `device="meta"` allocates nothing."""
    cls = model_class_for(config)
    if device is None:
        return cls(config)
    with torch.device(device):
        return cls(config)


register_draft(Eagle3Config, Eagle3DraftModel, Eagle3Trainer)
register_draft(DFlashConfig, DFlashDraftModel, DFlashTrainer)
register_draft(DSparkConfig, DSparkDraftModel, DSparkTrainer)
# K3 DSpark is DSpark with MLA attention: the DSpark trainer and loss serve it unchanged.
register_draft(K3DSparkConfig, K3DSparkModel, DSparkTrainer)
