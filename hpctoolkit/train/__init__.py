"""Training machinery shared by every draft family: building a family's trainer (`build`),
collating batches, FSDP, the loop, the optimizer, checkpoints and metrics; `run.train` is the entry
point. Each family's trainer and loss live in its folder under `hpctoolkit.models`, declared against
`models.common.trainer`; this package looks them up in `models.registry` and is never imported by
`models/`.

Imports torch and transformers only (never vllm or mooncake), so GPU trainer hosts need nothing else.
"""
