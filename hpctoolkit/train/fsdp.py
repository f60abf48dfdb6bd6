"""Process group, device mesh and FSDP2 (`fully_shard`) wrapping.

- `full_shard`: a 1-D mesh `("dp",)`; parameters, gradients and optimizer state are sharded.
- `replicate`: a 2-D mesh `("replicate", "shard")` of shape `(world, 1)`; FSDP2 treats it as
  HSDP with shard groups of one, i.e. plain data parallelism with one code path for checkpoints.

Gradients are averaged over ranks (FSDP's default), which is what the loss normalisation in
`losses/__init__.py` is written against. Mixed precision: `bf16` computes in bf16 and reduces in
fp32; the sharded parameters that AdamW updates stay fp32 (master weights) either way.
gloo on the CPU, NCCL on GPUs.
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


def shard_trainer(trainer: FamilyTrainer, mesh: DeviceMesh, cfg: TrainingConfig) -> FamilyTrainer:
    """`fully_shard` every decoder layer, then the root (embedding, projections, heads).

    The target head is buffers only, so FSDP leaves it whole on every rank.
    """
    policy = mp_policy(cfg)
    for unit in trainer.shard_units():
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(trainer, mesh=mesh, mp_policy=policy)
    return trainer
