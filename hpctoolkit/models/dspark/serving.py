"""How a DSpark draft is served: vLLM 0.32 `Qwen3DSparkModel` (`qwen3_dspark.py`).

vLLM 0.32 runs DSpark only in its V2 model runner, which needs Triton: none on the CPU build.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpctoolkit.models.dflash import serving as dflash
from hpctoolkit.models.serving import Serving, qwen3_fields

if TYPE_CHECKING:  # typing only: the config loads torch; this record must not
    from hpctoolkit.models.dspark.config import DSparkConfig

CPU_UNSERVABLE = "vLLM 0.32 serves DSpark only in its V2 model runner, which needs Triton (none on CPU)"
DEFAULT_BLOCK_SIZE = 7  # DSparkConfig's default, for a config.json that omits it


def block_fields(config: DSparkConfig) -> dict[str, Any]:
    return {
        **dflash.block_fields(config),
        "markov_rank": config.markov_rank,
        "enable_confidence_head": config.enable_confidence_head,
        "confidence_head_with_markov": config.confidence_head_with_markov,
    }


def config_fields(config: DSparkConfig) -> dict[str, Any]:
    return {**qwen3_fields(config), **block_fields(config)}


def min_loss_tokens(draft: Mapping[str, Any]) -> tuple[int, str]:
    """A DSpark sample shorter than two whole blocks carries no usable signal."""
    block = dflash.block_size_of(draft, DEFAULT_BLOCK_SIZE)
    return 2 * block, (
        f"2 x block_size ({2 * block}): a DSpark sample shorter than two whole blocks carries no "
        "usable signal"
    )


SERVING = Serving(
    family="dspark",
    model_type="dspark_draft",
    architectures=("Qwen3DSparkModel", "DSparkDraftModel"),
    served_architecture="Qwen3DSparkModel",
    vllm_method="dspark",
    title="DSpark",
    config_fields=config_fields,
    trained_depth=dflash.block_depth(DEFAULT_BLOCK_SIZE),
    unsupported=dflash.unsupported,
    cpu_unservable=CPU_UNSERVABLE,
    min_loss_tokens=min_loss_tokens,
)
