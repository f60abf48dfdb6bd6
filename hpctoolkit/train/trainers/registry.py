"""The trainer registry: draft family name (`models.families.families()`) -> trainer class.

Explicit and central: each family is registered once by name, a duplicate raises, and a miss
lists the valid names. DSpark and its Kimi-K3 MLA variant share `DSparkTrainer`; DFlash and
Eagle3 have their own. The family of a config is its exact type's, as the models registry says,
so no lookup depends on subclass order.
"""

from __future__ import annotations

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.config import DraftConfig
from hpctoolkit.models.registry import family_of
from hpctoolkit.train.trainers.base import FamilyTrainer
from hpctoolkit.train.trainers.dflash import DFlashTrainer
from hpctoolkit.train.trainers.dspark import DSparkTrainer
from hpctoolkit.train.trainers.eagle3 import Eagle3Trainer

_BY_FAMILY: dict[str, type[FamilyTrainer]] = {}


def register_trainer(family: str, trainer_cls: type[FamilyTrainer]) -> None:
    if family in _BY_FAMILY:
        raise ConfigError(
            f"a trainer for draft family {family!r} is already registered ({_BY_FAMILY[family].__name__})"
        )
    _BY_FAMILY[family] = trainer_cls


def trainer_families() -> list[str]:
    return sorted(_BY_FAMILY)


def trainer_class_for(config: DraftConfig | str) -> type[FamilyTrainer]:
    """The trainer of a draft config (by its family) or of a family name."""
    family = config if isinstance(config, str) else family_of(config)
    try:
        return _BY_FAMILY[family]
    except KeyError:
        raise ConfigError(
            f"no trainer for draft family {family!r}; known: {', '.join(trainer_families())}"
        ) from None


register_trainer("eagle3", Eagle3Trainer)
register_trainer("dflash", DFlashTrainer)
register_trainer("dspark", DSparkTrainer)
register_trainer("k3_dspark", DSparkTrainer)
