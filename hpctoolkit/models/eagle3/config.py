"""Eagle3 draft config."""

from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.config import DraftConfig


class Eagle3Config(DraftConfig):
    """One decoder layer over `cat(embed, fc(aux states))`.

    `eagle_aux_hidden_state_layer_ids` are the target capture ids; `norm_before_fc` adds one
    RMSNorm over the concatenated aux states (vLLM's `input_norm`), `fc_norm` one per aux layer.
    """

    model_type = "eagle3_draft"
    default_theta = 1000000.0

    def __init__(
        self,
        eagle_aux_hidden_state_layer_ids: list[int] | None = None,
        norm_before_fc: bool = False,
        fc_norm: bool = False,
        freeze_lm_head: bool = False,
        **kwargs: Any,
    ) -> None:
        self.eagle_aux_hidden_state_layer_ids = list(eagle_aux_hidden_state_layer_ids or [])
        self.norm_before_fc = norm_before_fc
        self.fc_norm = fc_norm
        self.freeze_lm_head = freeze_lm_head
        super().__init__(**kwargs)

    @property
    def num_aux_layers(self) -> int:
        return len(self.eagle_aux_hidden_state_layer_ids)

    def validate(self) -> None:
        super().validate()
        if not self.eagle_aux_hidden_state_layer_ids:
            raise ConfigError("eagle_aux_hidden_state_layer_ids: give the target capture ids")
        if self.num_hidden_layers != 1:
            raise ConfigError(f"num_hidden_layers={self.num_hidden_layers}: Eagle3 has exactly one layer")
