# ruff: noqa: N803, N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Rotary position embeddings: default, llama3 and YaRN (DeepSeek flavour).

Every variant takes its base from the configured `rope_theta`. A YaRN branch that fell back to
its own default base of 10000 once trained a draft declared at 50000 against the wrong
frequencies, so `RopeSpec.base` has no default: callers must say which base they mean.

Layouts: `interleaved=False` rotates the two halves of the head (NeoX, Qwen3);
`interleaved=True` rotates adjacent pairs (GPT-J, DeepSeek MLA's `qk_rope_head_dim` side),
which is what vLLM builds with `is_neox_style=False`.
"""

import math
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from hpctoolkit.errors import ConfigError

ROPE_TYPES = ("default", "llama3", "yarn")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction `0.1 * mscale * ln(scale) + 1` (1 when not extending)."""
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class RopeConfig(Protocol):
    """What `RopeSpec.from_config` reads: `rope_theta`, and `rope_parameters` where present
    (a `DraftConfig` has both, normalised)."""

    @property
    def rope_theta(self) -> float: ...


@dataclass(frozen=True)
class RopeSpec:
    """Resolved rotary parameters. `base` is the configured `rope_theta`."""

    rope_type: str
    base: float
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    @classmethod
    def from_config(cls, config: RopeConfig) -> "RopeSpec":
        """Read `config.rope_theta` and `config.rope_parameters` (normalised by `DraftConfig`)."""
        params = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ConfigError(f"rope_parameters.rope_type={rope_type!r}; known: {', '.join(ROPE_TYPES)}")
        base = float(config.rope_theta)
        if rope_type == "default":
            return cls("default", base)
        for key in ("factor", "original_max_position_embeddings"):
            if params.get(key) is None:
                raise ConfigError(f"rope_parameters.rope_type={rope_type!r} needs rope_parameters.{key}")
        factor = float(params["factor"])
        orig = params["original_max_position_embeddings"]
        if rope_type == "llama3":
            return cls(
                "llama3",
                base,
                factor=factor,
                original_max_position_embeddings=int(orig),
                low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            )
        return cls(
            "yarn",
            base,
            factor=factor,
            original_max_position_embeddings=int(orig),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=_opt_float(params.get("mscale")),
            mscale_all_dim=_opt_float(params.get("mscale_all_dim")),
            attention_factor=_opt_float(params.get("attention_factor")),
        )

    @property
    def cos_sin_scale(self) -> float:
        """Multiplier on cos/sin (YaRN's attention factor; 1 for the other types)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale_all_dim is not None:
            # DeepSeek puts mscale on cos/sin relative to mscale_all_dim, which is then folded into
            # the softmax scale instead (see `softmax_scale_factor`).
            return yarn_get_mscale(self.factor, self.mscale or 1.0) / yarn_get_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_get_mscale(self.factor)

    @property
    def softmax_scale_factor(self) -> float:
        """DeepSeek MLA multiplies `1/sqrt(d_qk)` by `mscale(factor, mscale_all_dim)**2` under YaRN."""
        if self.rope_type != "yarn" or not self.mscale_all_dim:
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2


def _opt_float(value: Any) -> float | None:
    """A JSON number or None (`rope_parameters` values)."""
    return None if value is None else float(value)


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def compute_inv_freq(spec: RopeSpec, dim: int) -> torch.Tensor:
    """Inverse frequencies `[dim // 2]` in fp32 for the given spec."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    pos_freqs = spec.base**exponents
    inv_freq = 1.0 / pos_freqs
    if spec.rope_type == "default":
        return inv_freq.float()
    orig = spec.original_max_position_embeddings
    if orig is None:
        raise ConfigError(f"rope_type={spec.rope_type!r} needs original_max_position_embeddings")
    if spec.rope_type == "llama3":
        low_wavelen = orig / spec.low_freq_factor
        high_wavelen = orig / spec.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        smooth = (orig / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
        smoothed = (1 - smooth) * inv_freq / spec.factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv_freq = torch.where(mid, smoothed, inv_freq)
    elif spec.rope_type == "yarn":
        low = math.floor(_yarn_correction_dim(spec.beta_fast, dim, spec.base, orig))
        high = math.ceil(_yarn_correction_dim(spec.beta_slow, dim, spec.base, orig))
        low, high = max(low, 0), min(high, dim - 1)
        width = high - low if high != low else 0.001  # avoid a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / width).clamp(0, 1)
        extrapolation_weight = 1.0 - ramp
        inv_freq = (inv_freq / spec.factor) * (1 - extrapolation_weight) + inv_freq * extrapolation_weight
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Produces `(cos, sin)` of shape `[B, S, dim]` in fp32 for integer positions `[B, S]`."""

    def __init__(self, dim: int, spec: RopeSpec, *, interleaved: bool = False) -> None:
        super().__init__()
        if dim % 2:
            raise ConfigError(f"rotary dim must be even, got {dim}")
        self.dim = dim
        self.spec = spec
        self.interleaved = interleaved
        # Not a buffer: `model.to(torch.bfloat16)` would round the frequencies. Kept per device.
        self._inv_freq_by_device: dict[torch.device, torch.Tensor] = {}

    @property
    def base(self) -> float:
        return self.spec.base

    @property
    def inv_freq(self) -> torch.Tensor:
        """`[dim // 2]` fp32 inverse frequencies, on the CPU."""
        return compute_inv_freq(self.spec, self.dim)

    def forward(self, positions_BS: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq_by_device.get(positions_BS.device)
        if inv_freq is None:
            inv_freq = self.inv_freq.to(positions_BS.device)
            self._inv_freq_by_device[positions_BS.device] = inv_freq
        freqs_BSF = positions_BS.float().unsqueeze(-1) * inv_freq
        if self.interleaved:
            emb = freqs_BSF.repeat_interleave(2, dim=-1)
        else:
            emb = torch.cat([freqs_BSF, freqs_BSF], dim=-1)
        scale = self.spec.cos_sin_scale
        return emb.cos() * scale, emb.sin() * scale

    def extra_repr(self) -> str:
        return f"dim={self.dim}, type={self.spec.rope_type}, base={self.spec.base}, interleaved={self.interleaved}"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    """Pairwise rotation `(x0, x1) -> (-x1, x0)` on adjacent channels (GPT-J / DeepSeek layout)."""
    x_even = x[..., 0::2]
    x_odd = x[..., 1::2]
    return torch.stack([-x_odd, x_even], dim=-1).flatten(-2)


def apply_rotary(
    x_BSHD: torch.Tensor, cos_BSD: torch.Tensor, sin_BSD: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """Rotate `x_BSHD` (heads on dim 2) in fp32 and return it in its own dtype."""
    rot = rotate_interleaved if interleaved else rotate_half
    x32 = x_BSHD.float()
    cos, sin = cos_BSD.unsqueeze(2), sin_BSD.unsqueeze(2)
    return (x32 * cos + rot(x32) * sin).to(x_BSHD.dtype)
