"""SwiGLU feed-forward block shared by every draft decoder layer."""

import torch
import torch.nn.functional as F
from torch import nn

from hpctoolkit.errors import ConfigError


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`; names match vLLM's `gate_proj`/`up_proj` stacking rules."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ConfigError(f"hidden_act={hidden_act!r} is not supported; the drafts use 'silu'")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
