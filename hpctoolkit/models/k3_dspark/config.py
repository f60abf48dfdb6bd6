"""Kimi-K3 DSpark MLA draft config."""

from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.dspark.config import DSparkConfig

K3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "num_hidden_layers": 5,
    "num_attention_heads": 64,
    "target_hidden_size": 7168,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
}


class K3DSparkConfig(DSparkConfig):
    """DSpark whose attention is DeepSeek MLA (`q_lora_rank`, `kv_lora_rank`, split qk dims, `v_head_dim`).

    Still a `DSparkConfig`, so anything dispatching on DSpark (the trainer) keeps working. The
    rotary always exists: the published checkpoint rotates the `qk_rope_head_dim` side, so there
    is no NoPE option, and `mla_use_nope=true` is rejected rather than silently ignored.
    `mla_use_output_gate` is kept so the model can refuse it: no weights exist for a gate.
    """

    model_type = "k3_dspark"
    default_theta = 50000.0

    def __init__(
        self,
        q_lora_rank: int = 1536,
        kv_lora_rank: int = 512,
        qk_nope_head_dim: int = 128,
        qk_rope_head_dim: int = 64,
        v_head_dim: int = 128,
        mla_use_output_gate: bool = False,
        mla_use_nope: bool = False,
        **kwargs: Any,
    ) -> None:
        self.q_lora_rank = q_lora_rank
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.mla_use_output_gate = mla_use_output_gate
        self.mla_use_nope = mla_use_nope
        # K3 shapes where a config omits them (see recipes/draft_models/README.md for sources).
        for key, value in K3_DEFAULTS.items():
            kwargs.setdefault(key, value)
        # MLA has no grouped KV heads; the GQA fields only keep the shared validation honest.
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        kwargs.setdefault("head_dim", qk_nope_head_dim + qk_rope_head_dim)
        super().__init__(**kwargs)

    def validate(self) -> None:
        super().validate()
        if self.mla_use_nope:
            raise ConfigError("mla_use_nope=true: the K3 MLA draft always rotates qk_rope_head_dim")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even")
