"""Kimi-K3 DSpark MLA draft: the DSpark forward with MLA attention, via the DFlash hooks."""

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.mla import MLAAttention
from hpctoolkit.models.common.rope import RopeSpec, RotaryEmbedding
from hpctoolkit.models.dflash.config import DFlashConfig
from hpctoolkit.models.dspark.model import DSparkDraftModel
from hpctoolkit.models.k3_dspark.config import K3DSparkConfig


class K3DSparkModel(DSparkDraftModel):
    """Same forward contract as `DSparkDraftModel` (see there).

    Module names follow vLLM's `K3DSparkForCausalLM` checkpoint: `context_proj`, `context_norm`,
    `final_norm`, and per layer `self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj}`. Q and K each get their own positions; only the
    interleaved `qk_rope_head_dim` channels rotate, and V never does.
    """

    config: K3DSparkConfig
    config_class: type[K3DSparkConfig] = K3DSparkConfig
    attention_class = MLAAttention
    context_proj_name = "context_proj"
    context_norm_name = "context_norm"
    final_norm_name = "final_norm"

    def build_rotary(self, config: DFlashConfig) -> RotaryEmbedding:
        if not isinstance(config, K3DSparkConfig):  # __init__ checked config_class already
            raise ConfigError(f"K3DSparkModel needs a K3DSparkConfig, got {type(config).__name__}")
        return RotaryEmbedding(config.qk_rope_head_dim, RopeSpec.from_config(config), interleaved=True)
