"""How a DFlash draft is served: vLLM 0.32 `DFlashDraftModel` (`qwen3_dflash.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctoolkit.models.serving import Serving, qwen3_fields

if TYPE_CHECKING:  # typing only: the config loads torch; this record must not
    from hpctoolkit.models.dflash.config import DFlashConfig


def block_fields(config: DFlashConfig) -> dict[str, Any]:
    """The block-drafting fields, top level and in vLLM's `dflash_config` nesting."""
    return {
        "block_size": config.block_size,
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "num_target_layers": config.num_target_layers,
        "target_hidden_size": config.target_hidden_size,
        "dflash_config": {
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": list(config.target_layer_ids),
        },
    }


def config_fields(config: DFlashConfig) -> dict[str, Any]:
    return {**qwen3_fields(config), **block_fields(config)}


def unsupported(config: DFlashConfig) -> list[str]:
    if config.fc_norm:
        return [
            "fc_norm: vLLM 0.32 DFlashQwen3Model / Qwen3DSparkModel (qwen3_dflash.py) have no "
            "per-target-layer norm before fc"
        ]
    return []


SERVING = Serving(
    family="dflash",
    model_type="dflash_draft",
    architectures=("DFlashDraftModel",),
    served_architecture="DFlashDraftModel",
    vllm_method="dflash",
    config_fields=config_fields,
    unsupported=unsupported,
)
