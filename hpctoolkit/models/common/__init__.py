"""Layers shared by every draft: norms, rotary embeddings, GQA and MLA attention, MLP."""

from hpctoolkit.models.common.attention import (
    ATTENTION_BACKENDS,
    AttentionMask,
    GQAAttention,
    attend,
    causal_mask,
)
from hpctoolkit.models.common.mla import MLAAttention
from hpctoolkit.models.common.mlp import GatedMLP
from hpctoolkit.models.common.norm import RMSNorm
from hpctoolkit.models.common.rope import (
    RopeSpec,
    RotaryEmbedding,
    apply_rotary,
    compute_inv_freq,
    rotate_half,
    rotate_interleaved,
    yarn_get_mscale,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionMask",
    "GQAAttention",
    "GatedMLP",
    "MLAAttention",
    "RMSNorm",
    "RopeSpec",
    "RotaryEmbedding",
    "apply_rotary",
    "attend",
    "causal_mask",
    "compute_inv_freq",
    "rotate_half",
    "rotate_interleaved",
    "yarn_get_mscale",
]
