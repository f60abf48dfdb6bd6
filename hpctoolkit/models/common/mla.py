# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""DeepSeek multi-head latent attention (MLA), as served by vLLM's K3 `MultiHeadLatentAttention`.

Q goes through the LoRA pair `q_a_proj -> q_a_layernorm -> q_b_proj`; K and V come from one
compressed latent: `kv_a_proj_with_mqa` yields `kv_lora_rank` latent channels plus one shared
`qk_rope_head_dim` rotary key, and `kv_b_proj` expands the normed latent to per-head
`qk_nope_head_dim` keys and `v_head_dim` values. Only the `qk_rope_head_dim` side is rotated, in
the interleaved layout, and V never is. The softmax scale is `1/sqrt(nope + rope)` times YaRN's
`mscale(factor, mscale_all_dim)**2`.
"""

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.attention import AttentionConfig, AttentionMask, RopePair, attend
from hpctoolkit.models.common.norm import RMSNorm
from hpctoolkit.models.common.rope import RopeSpec, apply_rotary


@runtime_checkable
class MLAConfig(AttentionConfig, Protocol):
    """An `AttentionConfig` with the MLA shapes (`K3DSparkConfig`) and the rotary base."""

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float


class MLAAttention(nn.Module):
    """MLA with the same dual-source `forward(x_BQD, kv_BKD, rope_q, rope_k, mask)` as `GQAAttention`."""

    interleaved_rope = True

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rms_norm_eps: float,
        rope_spec: RopeSpec,
        attention_backend: str = "sdpa",
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.backend = attention_backend
        self.softmax_scale = self.qk_head_dim**-0.5 * rope_spec.softmax_scale_factor

        self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(q_lora_rank, eps=rms_norm_eps)
        self.q_b_proj = nn.Linear(q_lora_rank, num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, eps=rms_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=False)

    @classmethod
    def from_config(
        cls, config: AttentionConfig, layer_idx: int, input_size: int | None = None
    ) -> "MLAAttention":
        # Built through the DFlash `attention_class` hook, which passes the model's config: a
        # config without the MLA shapes is a wrong pairing of config and model classes.
        if not isinstance(config, MLAConfig):
            raise ConfigError(
                f"MLAAttention needs an MLA config (q_lora_rank, kv_lora_rank, qk_nope_head_dim, "
                f"qk_rope_head_dim, v_head_dim), got {type(config).__name__}"
            )
        c = config
        if getattr(c, "mla_use_output_gate", False):
            raise NotImplementedError("mla_use_output_gate: no published MLA draft carries gate weights")
        if input_size not in (None, c.hidden_size):
            raise ConfigError("MLAAttention takes hidden_size-wide inputs only")
        return cls(
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            q_lora_rank=c.q_lora_rank,
            kv_lora_rank=c.kv_lora_rank,
            qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim,
            v_head_dim=c.v_head_dim,
            rms_norm_eps=c.rms_norm_eps,
            rope_spec=RopeSpec.from_config(c),
            attention_backend=c.attention_backend,
        )

    def forward(
        self,
        x_BQD: torch.Tensor,
        kv_BKD: torch.Tensor,
        rope_q: RopePair,
        rope_k: RopePair,
        mask: AttentionMask,
    ) -> torch.Tensor:
        B, Q, _ = x_BQD.shape
        K = kv_BKD.shape[1]
        H, nope, rope = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim

        q_BQHC = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BQD))).view(B, Q, H, self.qk_head_dim)
        q_nope, q_pe = q_BQHC.split([nope, rope], dim=-1)
        q_pe = apply_rotary(q_pe, *rope_q, interleaved=True)

        latent_BKL, k_pe_BKR = self.kv_a_proj_with_mqa(kv_BKD).split([self.kv_lora_rank, rope], dim=-1)
        kv_BKHC = self.kv_b_proj(self.kv_a_layernorm(latent_BKL)).view(B, K, H, nope + self.v_head_dim)
        k_nope, v_BKHE = kv_BKHC.split([nope, self.v_head_dim], dim=-1)
        k_pe_BK1R = apply_rotary(k_pe_BKR.unsqueeze(2), *rope_k, interleaved=True)

        q_BHQC = torch.cat([q_nope, q_pe], dim=-1).transpose(1, 2)
        k_BHKC = torch.cat([k_nope, k_pe_BK1R.expand(B, K, H, rope)], dim=-1).transpose(1, 2)
        out_BHQE = attend(
            q_BHQC, k_BHKC, v_BKHE.transpose(1, 2), mask, scale=self.softmax_scale, backend=self.backend
        )
        return self.o_proj(out_BHQE.transpose(1, 2).reshape(B, Q, H * self.v_head_dim))
