"""How an Eagle3 draft is served: vLLM 0.32 `Eagle3Qwen3ForCausalLM` (`qwen3_eagle3.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctoolkit.models.serving import Serving, TrainedDepth, qwen3_fields

if TYPE_CHECKING:  # typing only: the config loads torch; this record must not
    from hpctoolkit.models.eagle3.config import Eagle3Config


def config_fields(config: Eagle3Config) -> dict[str, Any]:
    return {
        **qwen3_fields(config),
        "eagle_aux_hidden_state_layer_ids": list(config.eagle_aux_hidden_state_layer_ids),
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm,
    }


def trained_depth(config: Any, ttt_length: int | None) -> TrainedDepth | None:
    """The test-time-training unroll: step `i` of `training.ttt_length` drafts position `i + 1`
    (`trainer`). A training setting, not the draft's: its `config.json` does not record it, so
    None (unknown) without the run's `ttt_length`."""
    return None if ttt_length is None else TrainedDepth(ttt_length, f"training.ttt_length {ttt_length}")


SERVING = Serving(
    family="eagle3",
    model_type="eagle3_draft",
    architectures=("Eagle3DraftModel", "Eagle3Qwen3ForCausalLM", "Eagle3LlamaForCausalLM"),
    served_architecture="Eagle3Qwen3ForCausalLM",
    vllm_method="eagle3",
    title="Eagle3",
    config_fields=config_fields,
    trained_depth=trained_depth,
)
