"""`DraftModel`: what every family's draft module has, for the code that handles any family.

Each family's model (`models/<family>/model.py`) subclasses it and narrows `config` to its own
config class. The registry, the checkpoints, the trainers and the simulated acceptance read
`config`, `embed_tokens` (the input embedding, copied from the target and frozen) and `lm_head`
(`[draft_vocab_size, hidden_size]`) without knowing the family. A family whose draft vocabulary
may be smaller than the target's (Eagle3) overrides `set_vocab_mapping`.
"""

import torch
from torch import nn

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.config import DraftConfig


class DraftModel(nn.Module):
    config: DraftConfig
    embed_tokens: nn.Embedding
    lm_head: nn.Linear

    def set_vocab_mapping(self, draft_to_target_ids: torch.Tensor) -> None:
        """Install a pruned vocabulary: entry `i` is the target id of draft token `i`."""
        raise ConfigError(
            f"{type(self).__name__} does not prune its vocabulary: draft_vocab_size="
            f"{self.config.draft_vocab_size} must equal vocab_size={self.config.vocab_size}"
        )
