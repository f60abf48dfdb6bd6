"""`DraftConfig`: the fields every draft shares, and RoPE normalisation for transformers 5.x.

transformers 5.x made `rope_scaling` a property aliasing `rope_parameters` and moved
`rope_theta` inside that dict, so the top-level attribute rope init used to read is gone. Every
draft config therefore normalises in one place, before `PreTrainedConfig.__init__` sees the
keys:

- `rope_scaling` and `rope_parameters` collapse to one dict; an explicit legacy `rope_scaling`
  wins, because a config that still spells it that way was written against that meaning;
- `rope_theta` is resolved (nested value, else top-level, else the class default) and lifted to
  `self.rope_theta`, which `RopeSpec.from_config` reads; it also stays in the dict so a config
  written back out round-trips;
- a partial YaRN block gets DeepSeek-V3's published defaults for the keys it omits.
"""

import copy
import logging
from typing import Any

from transformers import PretrainedConfig

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.attention import ATTENTION_BACKENDS, check_gqa_heads
from hpctoolkit.models.common.rope import ROPE_TYPES

logger = logging.getLogger(__name__)

# Bookkeeping keys any HF config.json may carry; everything else must be a field we read.
_HF_KEYS = frozenset(PretrainedConfig().to_dict()) | {
    "torch_dtype",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "tie_word_embeddings",
    "initializer_range",
    "use_cache",
    "name_or_path",
}

# DeepSeek-V3's `rope_scaling` block (config.json of deepseek-ai/DeepSeek-V3).
DEEPSEEK_YARN_DEFAULTS: dict[str, Any] = {
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def normalize_rope(kwargs: dict[str, Any], default_theta: float) -> tuple[dict[str, Any], float]:
    """Pop the RoPE keys from `kwargs`; return `(rope_parameters, rope_theta)`."""
    legacy = kwargs.pop("rope_scaling", None)
    modern = kwargs.pop("rope_parameters", None)
    top_theta = kwargs.pop("rope_theta", None)
    params = copy.deepcopy(legacy if legacy else modern) or {}
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if params["rope_type"] not in ROPE_TYPES:
        raise ConfigError(f"rope_type={params['rope_type']!r}; known: {', '.join(ROPE_TYPES)}")
    theta = params.get("rope_theta", top_theta if top_theta is not None else default_theta)
    params["rope_theta"] = float(theta)
    if params["rope_type"] == "yarn":
        for key, value in DEEPSEEK_YARN_DEFAULTS.items():
            params.setdefault(key, value)
    return params, float(theta)


class DraftConfig(PretrainedConfig):
    """Shape and training fields common to all drafts; algorithm configs extend it.

    `target_hidden_size` is the width of one captured target layer. `draft_vocab_size` may be
    smaller than `vocab_size` (Eagle3's pruned vocabulary); `None` means equal.
    """

    model_type = "hpc_draft"
    default_theta = 10000.0

    def __init__(
        self,
        vocab_size: int = 151936,
        hidden_size: int = 4096,
        intermediate_size: int = 12288,
        num_hidden_layers: int = 1,
        num_attention_heads: int = 32,
        num_key_value_heads: int = 8,
        head_dim: int | None = None,
        hidden_act: str = "silu",
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 40960,
        target_hidden_size: int | None = None,
        draft_vocab_size: int | None = None,
        attention_backend: str = "sdpa",
        attention_bias: bool = False,
        **kwargs: Any,
    ) -> None:
        self.rope_parameters, self.rope_theta = normalize_rope(kwargs, self.default_theta)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.target_hidden_size = target_hidden_size or hidden_size
        self.draft_vocab_size = draft_vocab_size or vocab_size
        self.attention_backend = attention_backend
        self.attention_bias = attention_bias
        ignored = sorted(set(kwargs) - _HF_KEYS)
        if ignored:
            # Kept as attributes (a published config round-trips), but nothing reads them.
            logger.warning("%s ignores config keys %s", type(self).__name__, ", ".join(ignored))
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
        # PreTrainedConfig may re-standardise the dict; keep our resolved theta authoritative.
        self.rope_parameters["rope_theta"] = self.rope_theta
        self.validate()

    def validate(self) -> None:
        """Cross-field rules, checked in one place; subclasses extend and call super()."""
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend={self.attention_backend!r}; known: {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.draft_vocab_size > self.vocab_size:
            raise ConfigError(
                f"draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}"
            )
        check_gqa_heads(self.num_attention_heads, self.num_key_value_heads)
