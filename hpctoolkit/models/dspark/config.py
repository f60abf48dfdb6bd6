"""DSpark draft config: DFlash plus the markov and confidence heads."""

from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.dflash.config import DFlashConfig


class DSparkConfig(DFlashConfig):
    """`markov_rank` sizes the low-rank bigram head (`vocab -> r -> draft_vocab`).

    `enable_confidence_head` adds a per-slot acceptance logit; with `confidence_head_with_markov`
    it also reads the markov features. Blocks default to 7 slots.
    """

    model_type = "dspark_draft"

    def __init__(
        self,
        markov_rank: int = 256,
        enable_confidence_head: bool = True,
        confidence_head_with_markov: bool = True,
        block_size: int = 7,
        **kwargs: Any,
    ) -> None:
        self.markov_rank = markov_rank
        self.enable_confidence_head = enable_confidence_head
        self.confidence_head_with_markov = confidence_head_with_markov
        super().__init__(block_size=block_size, **kwargs)

    def validate(self) -> None:
        super().validate()
        if self.markov_rank < 1:
            raise ConfigError(f"markov_rank={self.markov_rank} must be positive")
        if self.confidence_head_with_markov and not self.enable_confidence_head:
            raise ConfigError("confidence_head_with_markov needs enable_confidence_head=true")
