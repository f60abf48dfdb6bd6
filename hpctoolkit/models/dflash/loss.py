# ruff: noqa: N803  -- shape-suffixed tensor names (hidden_BTH), per STYLE.md
"""DFlash loss: cross-entropy of every non-anchor slot, fused with `lm_head`."""

import torch

from hpctoolkit.models.common.fused_ce import fused_linear_cross_entropy


def block_cross_entropy(
    hidden_BTH: torch.Tensor,
    lm_head_weight_VH: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    chunk_size: int = 4096,
    compile_elementwise: bool = False,
) -> torch.Tensor:
    """Mean CE against `BlockLayout.labels`, without materialising `[B, T, V]` logits."""
    loss, _ = fused_linear_cross_entropy(
        hidden_BTH.flatten(0, 1),
        lm_head_weight_VH,
        labels_BT.flatten(),
        chunk_size=chunk_size,
        compile_elementwise=compile_elementwise,
    )
    return loss
