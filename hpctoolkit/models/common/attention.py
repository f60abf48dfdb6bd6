# ruff: noqa: N802, N803, N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Attention backends (sdpa, FlexAttention) and the Qwen3-style GQA block.

A mask is described once, as a FlexAttention `mask_mod(b, h, q_idx, kv_idx) -> bool` over
integer tensors, and each backend derives what it needs from it: sdpa a dense boolean
`[B, 1, Q, K]` tensor, flex a sparse `BlockMask`. Both are built lazily and cached on the
`AttentionMask`, so every layer of one forward shares them.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.block_mask import build_block_mask
from hpctoolkit.models.common.norm import RMSNorm
from hpctoolkit.models.common.rope import apply_rotary

ATTENTION_BACKENDS = ("sdpa", "flex")


def check_gqa_heads(num_heads: int, num_kv_heads: int) -> None:
    """Grouped-query attention shares each KV head among a whole number of query heads."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ConfigError(
            f"num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}"
        )


MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class AttentionMask:
    """Visibility for one forward: `mask_mod` is True where query `q_idx` may read key `kv_idx`."""

    mask_mod: MaskMod
    batch: int
    q_len: int
    kv_len: int
    device: torch.device
    _dense: torch.Tensor | None = field(default=None, repr=False)
    _block: object | None = field(default=None, repr=False)

    def materialize(self, backend: str) -> "AttentionMask":
        """Build the backend's mask now, outside any compiled region; returns self."""
        if backend == "flex":
            self.block_mask()
        else:
            self.dense_B1QK()
        return self

    def dense_B1QK(self) -> torch.Tensor:
        if self._dense is None:
            b = torch.arange(self.batch, device=self.device).view(-1, 1, 1)
            q = torch.arange(self.q_len, device=self.device).view(1, -1, 1)
            kv = torch.arange(self.kv_len, device=self.device).view(1, 1, -1)
            h = torch.zeros((), dtype=torch.long, device=self.device)
            self._dense = self.mask_mod(b, h, q, kv).unsqueeze(1)
        return self._dense

    def block_mask(self) -> object:
        if self._block is None:
            self._block = build_block_mask(self.mask_mod, self.batch, self.q_len, self.kv_len, self.device)
        return self._block


def causal_mask(batch: int, seq_len: int, device: torch.device) -> AttentionMask:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        return q >= kv

    return AttentionMask(mask_mod, batch, seq_len, seq_len, device)


_compiled_flex: Callable | None = None


def _flex_fn(device: torch.device) -> Callable:
    global _compiled_flex
    if device.type != "cuda":
        return flex_attention  # eager reference path; fine for CPU tests
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


# FlexAttention kernel options measured on an H200 (sm_90, torch 2.11) at the K3 DSpark MLA
# draft's shape: bf16, qk dim 192 (Triton pads it to 256), v dim 128, 64 heads, 3584 queries over
# 7680 keys at 27 % mask density (`benchmarks/flex_sweep.py`). Inductor's defaults there run the
# backward at 14.7 ms, 102 TFLOP/s; these run it at 8.1 ms, 185 TFLOP/s, and the forward 2.8 ->
# 2.6 ms. Anything else keeps inductor's defaults.
_FLEX_OPTIONS_SM90_WIDE_QK = {
    "fwd_BLOCK_M": 128,
    "fwd_BLOCK_N": 64,
    "fwd_num_stages": 2,
    "fwd_num_warps": 8,
    "bwd_BLOCK_M1": 32,
    "bwd_BLOCK_N1": 128,
    "bwd_BLOCK_M2": 128,
    "bwd_BLOCK_N2": 32,
    "bwd_num_stages": 3,
    "bwd_num_warps": 8,
}


def flex_kernel_options(q_BHQD: torch.Tensor, v_BGKE: torch.Tensor) -> dict | None:
    """Tuned FlexAttention options for this call, or None for inductor's defaults."""
    if q_BHQD.device.type != "cuda" or q_BHQD.dtype not in (torch.bfloat16, torch.float16):
        return None
    if torch.cuda.get_device_capability(q_BHQD.device) != (9, 0):
        return None
    if 128 < q_BHQD.shape[-1] <= 256 and v_BGKE.shape[-1] <= 128:
        return dict(_FLEX_OPTIONS_SM90_WIDE_QK)
    return None


def attend(
    q_BHQD: torch.Tensor,
    k_BGKD: torch.Tensor,
    v_BGKE: torch.Tensor,
    mask: AttentionMask,
    *,
    scale: float,
    backend: str = "sdpa",
) -> torch.Tensor:
    """Masked attention; `G` (kv heads) may divide `H`. Returns `[B, H, Q, E]`."""
    gqa = k_BGKD.shape[1] != q_BHQD.shape[1]
    if backend == "sdpa":
        return F.scaled_dot_product_attention(
            q_BHQD, k_BGKD, v_BGKE, attn_mask=mask.dense_B1QK(), scale=scale, enable_gqa=gqa
        )
    if backend == "flex":
        return _flex_fn(q_BHQD.device)(
            q_BHQD,
            k_BGKD,
            v_BGKE,
            block_mask=mask.block_mask(),
            scale=scale,
            enable_gqa=gqa,
            kernel_options=flex_kernel_options(q_BHQD, v_BGKE),
        )
    raise ConfigError(f"attention_backend={backend!r}; known: {', '.join(ATTENTION_BACKENDS)}")


RopePair = tuple[torch.Tensor, torch.Tensor]


class AttentionConfig(Protocol):
    """The config fields the attention layers' `from_config` read (every `DraftConfig` has them)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_backend: str
    attention_bias: bool


class GQAAttention(nn.Module):
    """Qwen3 grouped-query attention with per-head `q_norm`/`k_norm`.

    `forward(x_BQD, kv_BKD, rope_q, rope_k, mask)`: queries come from `x_BQD`, keys and values
    from `kv_BKD` through the same projections. Self-attention passes the same tensor twice;
    DFlash passes `cat(context, draft)` as `kv_BKD`. `rope_q`/`rope_k` are `(cos, sin)` for
    the Q and K positions, which may differ.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rms_norm_eps: float,
        input_size: int | None = None,
        attention_backend: str = "sdpa",
        attention_bias: bool = False,
    ) -> None:
        super().__init__()
        check_gqa_heads(num_heads, num_kv_heads)
        input_size = input_size or hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = attention_backend
        self.q_proj = nn.Linear(input_size, num_heads * head_dim, bias=attention_bias)
        self.k_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=attention_bias)
        self.v_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=attention_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=attention_bias)
        self.q_norm = RMSNorm(head_dim, eps=rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, eps=rms_norm_eps)

    @classmethod
    def from_config(
        cls, config: AttentionConfig, layer_idx: int, input_size: int | None = None
    ) -> "GQAAttention":
        c = config
        return cls(
            hidden_size=c.hidden_size,
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            rms_norm_eps=c.rms_norm_eps,
            input_size=input_size,
            attention_backend=c.attention_backend,
            attention_bias=c.attention_bias,
        )

    def project(
        self, x_BQD: torch.Tensor, kv_BKD: torch.Tensor, rope_q: RopePair, rope_k: RopePair
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated `q_BHQD` and `k_BGKD`, and `v_BGKD`, in the layout `attend` takes."""
        B, Q, _ = x_BQD.shape
        K = kv_BKD.shape[1]
        q_BQHD = self.q_norm(self.q_proj(x_BQD).view(B, Q, self.num_heads, self.head_dim))
        k_BKGD = self.k_norm(self.k_proj(kv_BKD).view(B, K, self.num_kv_heads, self.head_dim))
        v_BKGD = self.v_proj(kv_BKD).view(B, K, self.num_kv_heads, self.head_dim)
        q_BQHD = apply_rotary(q_BQHD, *rope_q)
        k_BKGD = apply_rotary(k_BKGD, *rope_k)
        return q_BQHD.transpose(1, 2), k_BKGD.transpose(1, 2), v_BKGD.transpose(1, 2)

    def attend_projected(
        self, q_BHQD: torch.Tensor, k_BGKD: torch.Tensor, v_BGKD: torch.Tensor, mask: AttentionMask
    ) -> torch.Tensor:
        """Attention over already projected keys/values (e.g. a cache), then `o_proj`."""
        B, _, Q, _ = q_BHQD.shape
        out_BHQD = attend(q_BHQD, k_BGKD, v_BGKD, mask, scale=self.head_dim**-0.5, backend=self.backend)
        return self.o_proj(out_BHQD.transpose(1, 2).reshape(B, Q, -1))

    def forward(
        self,
        x_BQD: torch.Tensor,
        kv_BKD: torch.Tensor,
        rope_q: RopePair,
        rope_k: RopePair,
        mask: AttentionMask,
    ) -> torch.Tensor:
        return self.attend_projected(*self.project(x_BQD, kv_BKD, rope_q, rope_k), mask)
