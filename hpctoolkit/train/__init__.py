"""Training: per-family losses and trainers, FSDP, checkpoints, metrics; `run.train` is the entry point.

Imports torch and transformers only (never vllm or mooncake), so GPU trainer hosts need nothing else.
"""
