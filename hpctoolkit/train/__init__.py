"""Training machinery shared by every draft family: the trainer base class and how a trainer is
built (`trainers/`), common loss pieces (`losses`), batches, FSDP, the loop, the optimizer,
checkpoints and metrics; `run.train` is the entry point. Each family's own trainer and loss live in
its folder under `hpctoolkit.models`.

Imports torch and transformers only (never vllm or mooncake), so GPU trainer hosts need nothing else.
"""
