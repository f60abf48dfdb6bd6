"""How an Eagle3 draft is served: vLLM 0.32 `Eagle3Qwen3ForCausalLM` (`qwen3_eagle3.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctoolkit.models.serving import Serving, qwen3_fields

if TYPE_CHECKING:  # typing only: the config loads torch; this record must not
    from hpctoolkit.models.eagle3.config import Eagle3Config


def config_fields(config: Eagle3Config) -> dict[str, Any]:
    return {
        **qwen3_fields(config),
        "eagle_aux_hidden_state_layer_ids": list(config.eagle_aux_hidden_state_layer_ids),
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm,
    }


SERVING = Serving(
    family="eagle3",
    model_type="eagle3_draft",
    architectures=("Eagle3DraftModel", "Eagle3Qwen3ForCausalLM", "Eagle3LlamaForCausalLM"),
    served_architecture="Eagle3Qwen3ForCausalLM",
    vllm_method="eagle3",
    config_fields=config_fields,
)
