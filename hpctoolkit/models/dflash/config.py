"""DFlash draft config."""

from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.config import DraftConfig


class DFlashConfig(DraftConfig):
    """A block-diffusion draft conditioned on captured target layers.

    `target_layer_ids` are the target's capture ids (their count is `num_target_layers`);
    `block_size` tokens are drafted per anchor, position 0 being the known anchor token and
    the rest `mask_token_id`. `fc_norm` adds one RMSNorm per captured layer ahead of the context
    projection; it defaults off so existing checkpoints keep their module names and numerics.
    `dflash_config` (vLLM's nesting of `mask_token_id` / `target_layer_ids`) is accepted as input.

    `decay_gamma` is a training setting: the loss weights slot `k` of a block `exp(-(k-1)/gamma)`;
    0 picks the family's default (DFlash: the paper's gamma for the block size, 7 for 16, 5 for
    10, 4 for 8, else block_size/2; DSpark: 4). Serving never reads it.
    """

    model_type = "dflash_draft"
    default_theta = 1000000.0

    def __init__(
        self,
        target_layer_ids: list[int] | None = None,
        num_target_layers: int | None = None,
        block_size: int = 16,
        mask_token_id: int | None = None,
        fc_norm: bool = False,
        freeze_lm_head: bool = True,
        decay_gamma: float = 0.0,
        **kwargs: Any,
    ) -> None:
        nested = kwargs.pop("dflash_config", None) or {}
        target_layer_ids = (
            target_layer_ids if target_layer_ids is not None else nested.get("target_layer_ids")
        )
        mask_token_id = mask_token_id if mask_token_id is not None else nested.get("mask_token_id")
        self.target_layer_ids = list(target_layer_ids or [])
        self.num_target_layers = (
            num_target_layers if num_target_layers is not None else len(self.target_layer_ids)
        )
        self.block_size = block_size
        self.mask_token_id = mask_token_id
        self.fc_norm = fc_norm
        self.freeze_lm_head = freeze_lm_head
        self.decay_gamma = decay_gamma
        super().__init__(**kwargs)

    def validate(self) -> None:
        super().validate()
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids: give the target capture ids the draft reads")
        if self.num_target_layers != len(self.target_layer_ids):
            raise ConfigError(
                f"num_target_layers={self.num_target_layers} but target_layer_ids has "
                f"{len(self.target_layer_ids)} entries; drop num_target_layers or make them agree"
            )
        if sorted(set(self.target_layer_ids)) != list(self.target_layer_ids):
            raise ConfigError(f"target_layer_ids={self.target_layer_ids} must be strictly ascending")
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size}: a block needs an anchor and one masked slot")
        if not self.decay_gamma >= 0:
            raise ConfigError(f"decay_gamma={self.decay_gamma} must be >= 0 (0: the family's default)")
        if self.mask_token_id is None or not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id={self.mask_token_id} must be a token id below vocab_size")
