"""Process group, device mesh and FSDP2 (`fully_shard`) wrapping.

- `full_shard`: a 1-D mesh `("dp",)`; parameters, gradients and optimizer state are sharded.
- `replicate`: a 2-D mesh `("replicate", "shard")` of shape `(world, 1)`; FSDP2 treats it as
  HSDP with shard groups of one, i.e. plain data parallelism with one code path for checkpoints.

Gradients are averaged over ranks (FSDP's default), which is what the loss normalisation in
`losses/__init__.py` is written against. Mixed precision: `bf16` computes in bf16 and reduces in
fp32; the sharded parameters that AdamW updates stay fp32 (master weights) either way.
gloo on the CPU, NCCL on GPUs.

`shard_trainer` is the whole per-rank preparation, in this order: activation checkpointing of
the first `training.activation_checkpoint_layers` decoder layers, `torch.compile` of each
decoder layer (`training.compile`), then `fully_shard`. Frozen parameters (the draft's
target-shared embedding and lm_head, 2.35 B at K3 shapes) are left out of FSDP: they are cast
once to the compute dtype and replicated, like the target head, instead of being kept as fp32
shards and all-gathered (and cast) every step. With shard groups of one rank, nothing is freed
by resharding after forward, so layers keep their gathered bf16 weights until backward.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hpctoolkit.errors import ConfigError
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.trainers.base import FamilyTrainer


@dataclass
class DistContext:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(rank: int, world_size: int, init_method: str, device: str) -> DistContext:
    """Join (or, for one in-process rank, create) the default process group."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("training.device=cuda but torch sees no CUDA device")
        local = int(os.environ.get("LOCAL_RANK", rank % max(torch.cuda.device_count(), 1)))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        backend = "nccl"
    else:
        dev = torch.device("cpu")
        backend = "gloo"
    owns = False
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        owns = True
    elif dist.get_world_size() != world_size:
        raise ConfigError(
            f"training.world_size={world_size} but the running process group has {dist.get_world_size()} ranks"
        )
    return DistContext(dist.get_rank(), world_size, dev, owns)


def build_mesh(ctx: DistContext, mode: str) -> DeviceMesh:
    if mode == "full_shard":
        return init_device_mesh(ctx.device.type, (ctx.world_size,), mesh_dim_names=("dp",))
    if mode == "replicate":
        return init_device_mesh(ctx.device.type, (ctx.world_size, 1), mesh_dim_names=("replicate", "shard"))
    raise ConfigError(f"training.fsdp_mode={mode!r}; known: full_shard, replicate")


def mp_policy(cfg: TrainingConfig) -> MixedPrecisionPolicy:
    if cfg.mixed_precision == "bf16":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def compile_enabled(cfg: TrainingConfig) -> bool:
    return cfg.compile == "on" or (cfg.compile == "auto" and cfg.device == "cuda")


def apply_activation_checkpointing(trainer: FamilyTrainer, num_layers: int) -> None:
    if num_layers == 0:
        return
    setter = getattr(trainer.draft, "set_activation_checkpointing", None)
    if setter is None:
        raise ConfigError(
            f"training.activation_checkpoint_layers={num_layers}: the {trainer.family} draft has no "
            "per-layer activation checkpointing; set it to 0"
        )
    try:
        setter(num_layers)
    except ConfigError as err:
        raise ConfigError(f"training.activation_checkpoint_layers={num_layers}: {err}") from err


def freeze_to_compute_dtype(trainer: FamilyTrainer, cfg: TrainingConfig) -> set[torch.nn.Parameter]:
    """Frozen parameters, cast to the compute dtype in place; FSDP is told to ignore them."""
    frozen = {p for p in trainer.parameters() if not p.requires_grad}
    dtype = mp_policy(cfg).param_dtype
    if dtype is not None:
        for p in frozen:
            p.data = p.data.to(dtype)
    return frozen


def shard_trainer(trainer: FamilyTrainer, mesh: DeviceMesh, cfg: TrainingConfig) -> FamilyTrainer:
    """Checkpoint, compile, then `fully_shard` every decoder layer and the root (see module doc).

    The target head is buffers only, so FSDP leaves it whole on every rank.
    """
    units = trainer.shard_units()
    apply_activation_checkpointing(trainer, cfg.activation_checkpoint_layers)
    if compile_enabled(cfg):
        compile_draft = getattr(trainer.draft, "compile_layers", None)
        if compile_draft is not None:
            compile_draft()
        else:
            for unit in units:
                unit.compile(dynamic=False)
    frozen = freeze_to_compute_dtype(trainer, cfg)
    policy = mp_policy(cfg)
    reshard = mesh.size(mesh.ndim - 1) > 1
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, ignored_params=frozen)
    fully_shard(trainer, mesh=mesh, mp_policy=policy, ignored_params=frozen)
    return trainer
