"""How a DFlash draft is served: vLLM 0.32 `DFlashDraftModel` (`qwen3_dflash.py`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hpctoolkit.models.serving import Serving, TrainedDepth, field_of, qwen3_fields

if TYPE_CHECKING:  # typing only: the config loads torch; this record must not
    from hpctoolkit.models.dflash.config import DFlashConfig

DEFAULT_BLOCK_SIZE = 16  # DFlashConfig's default, for a config.json that omits it


def block_size_of(config: Any, default: int) -> int:
    """A block family's `block_size` from a `config.json` dict (top level, else vLLM's
    `dflash_config` nesting) or a config instance; `default` where it gives none."""
    nested = field_of(config, "dflash_config") or {}
    return int(field_of(config, "block_size") or nested.get("block_size") or default)


def block_depth(default_block_size: int) -> Callable[[Any, int | None], TrainedDepth]:
    """`Serving.trained_depth` of a block family: slot 0 of a block is the known anchor token
    (`layout`: its label is ignored), so the loss scores `block_size - 1` draft positions."""

    def trained_depth(config: Any, ttt_length: int | None) -> TrainedDepth:
        block = block_size_of(config, default_block_size)
        return TrainedDepth(block - 1, f"block_size {block}")

    return trained_depth


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
    title="DFlash",
    config_fields=config_fields,
    trained_depth=block_depth(DEFAULT_BLOCK_SIZE),
    unsupported=unsupported,
)
