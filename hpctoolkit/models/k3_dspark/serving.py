"""How the Kimi-K3 DSpark MLA draft is served: vLLM 0.32 `K3DSparkModel`
(`models/kimi_k3/nvidia/dspark_mla.py`), through the DSpark method."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpctoolkit.models.dspark import serving as dspark
from hpctoolkit.models.serving import Serving

if TYPE_CHECKING:  # typing only: the config loads torch; this record must not
    from hpctoolkit.models.k3_dspark.config import K3DSparkConfig


def config_fields(config: K3DSparkConfig) -> dict[str, Any]:
    return {
        "model_type": "k3_dspark",
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads,
        "q_lora_rank": config.q_lora_rank,
        "kv_lora_rank": config.kv_lora_rank,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rope_parameters": dict(config.rope_parameters),
        "tie_word_embeddings": False,
        **dspark.block_fields(config),
    }


def unsupported(config: K3DSparkConfig) -> list[str]:
    missing = []
    if config.fc_norm:
        missing.append(
            "fc_norm: vLLM 0.32 K3DSparkForCausalLM (models/kimi_k3/nvidia/dspark_mla.py) applies "
            "context_proj + context_norm only and has no per-target-layer norm"
        )
    if config.draft_vocab_size != config.vocab_size:
        missing.append(
            "draft_vocab_size < vocab_size: vLLM 0.32 K3DSparkConfig requires the full target vocabulary"
        )
    if not config.freeze_lm_head:
        missing.append("a trained lm_head: vLLM 0.32 K3DSparkForCausalLM always aliases the target's lm_head")
    if config.mla_use_output_gate:
        missing.append("mla_use_output_gate: no gate weights exist to serve")
    return missing


SERVING = Serving(
    family="k3_dspark",
    model_type="k3_dspark",
    architectures=("K3DSparkModel",),
    served_architecture="K3DSparkModel",
    vllm_method="dspark",
    title="K3 DSpark MLA",
    config_fields=config_fields,
    trained_depth=dspark.SERVING.trained_depth,
    unsupported=unsupported,
    cpu_unservable=dspark.CPU_UNSERVABLE,
    min_loss_tokens=dspark.min_loss_tokens,
)
