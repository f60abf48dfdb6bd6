"""DFlash: block drafting from captured target layers with dual-source attention."""

from hpctoolkit.models.dflash.config import DFlashConfig
from hpctoolkit.models.dflash.layout import (
    IGNORE_INDEX,
    BlockLayout,
    block_attention_mask,
    k_position_ids,
    make_block_layout,
    q_position_ids,
    sample_anchors,
)
from hpctoolkit.models.dflash.loss import block_cross_entropy
from hpctoolkit.models.dflash.model import DFlashDecoderLayer, DFlashDraftModel, DFlashOutput

__all__ = [
    "IGNORE_INDEX",
    "BlockLayout",
    "DFlashConfig",
    "DFlashDecoderLayer",
    "DFlashDraftModel",
    "DFlashOutput",
    "block_attention_mask",
    "block_cross_entropy",
    "k_position_ids",
    "make_block_layout",
    "q_position_ids",
    "sample_anchors",
]
