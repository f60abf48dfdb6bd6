"""Draft models: shared layers in `common`, one package per algorithm, and the registry.

Imports only torch, transformers and safetensors, so GPU training hosts without vLLM or
Mooncake can use it.
"""

from hpctoolkit.models.checkpoint import load_draft, save_draft
from hpctoolkit.models.common.config import DraftConfig
from hpctoolkit.models.dflash import DFlashConfig, DFlashDraftModel
from hpctoolkit.models.dspark import DSparkConfig, DSparkDraftModel
from hpctoolkit.models.eagle3 import Eagle3Config, Eagle3DraftModel
from hpctoolkit.models.families import known_names
from hpctoolkit.models.k3_dspark import K3DSparkConfig, K3DSparkModel
from hpctoolkit.models.registry import (
    architecture_for,
    build_draft_model,
    config_class_for,
    config_from_dict,
    load_draft_config,
    model_class_for,
    register_draft,
)

__all__ = [
    "DFlashConfig",
    "DFlashDraftModel",
    "DSparkConfig",
    "DSparkDraftModel",
    "DraftConfig",
    "Eagle3Config",
    "Eagle3DraftModel",
    "K3DSparkConfig",
    "K3DSparkModel",
    "architecture_for",
    "build_draft_model",
    "config_class_for",
    "config_from_dict",
    "known_names",
    "load_draft",
    "load_draft_config",
    "model_class_for",
    "register_draft",
    "save_draft",
]
