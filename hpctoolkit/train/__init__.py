"""Training: per-family losses and trainers, FSDP, checkpoints, metrics; `run.train` is the entry point.

Imports torch and transformers only (never vllm or mooncake), so GPU trainer hosts need nothing else.
"""

# The recipe schema imports `train.config`, and `train.config` imports `config.fields`; importing
# the config package first makes either import order resolve.
import hpctoolkit.config  # noqa: F401
