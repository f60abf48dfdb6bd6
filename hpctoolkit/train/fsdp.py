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

On a mesh of one rank, FSDP has nothing to shard or reduce, yet its all-gather copy-in and
copy-out, reduce-scatter `chunk_cat` and post-backward copies cost about 25 ms a step at K3
shapes on one H200 (`benchmarks/train_k3_gpu.py`). There `shard_trainer` applies
`LocalMixedPrecision` instead: the same step as FSDP2 at one rank, bit for bit (the bf16 copies of
the fp32 weights, the floating inputs of the trainer and of each decoder layer cast to the compute
dtype, the bf16 gradients cast to fp32 into the fp32 parameters' `.grad`), with one cast of the
weights before forward and one of each gradient as backward produces it. Parameters stay plain
fp32 tensors under their own names, so checkpoints and the optimizer see what they see with FSDP.
With `mixed_adamw.MixedAdamW` (CUDA, picked by `optim.build_optimizer`) neither cast runs: the
twins keep their bf16 gradients and the optimizer's kernel writes the twins as it updates.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from hpctoolkit import envs
from hpctoolkit.errors import ConfigError, StoreError
from hpctoolkit.models.common.trainer import FamilyTrainer
from hpctoolkit.train.config import TrainingConfig


@dataclass
class DistContext:
    rank: int
    world_size: int
    device: torch.device
    owns_group: bool
    # The group for host-side flags (gloo): a CPU collective never waits for the device's queue.
    host_group: Any = None

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


# Every rank joins the process group within this of the first (they start together; a rank that
# died or never started is named instead of waited for).
GROUP_JOIN_TIMEOUT_S = 600
# One collective waits for its slowest rank at most this long (torch's own default, made explicit:
# a rank may wait that long on the engines for its next batch while the others wait in a collective).
COLLECTIVE_TIMEOUT_S = 1800


def _join_group(backend: str, init_method: str, rank: int, world_size: int) -> None:
    """`init_process_group`, its rendezvous bounded by `GROUP_JOIN_TIMEOUT_S` (a StoreError naming
    what it waited for) and its collectives by `COLLECTIVE_TIMEOUT_S`."""
    join = timedelta(seconds=GROUP_JOIN_TIMEOUT_S)
    try:
        store = _listening_store(world_size, join) if init_method == "env://" and rank == 0 else None
        if store is None:
            made, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=join))
            # What init_process_group does to a store it makes, and what rank 0's listening store
            # is: every rank must use the same key prefix.
            store = dist.PrefixStore("default_pg", made)
    except (RuntimeError, ValueError) as err:  # DistStoreError is a RuntimeError
        where = init_method
        if init_method.startswith("env://"):
            where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise StoreError(
            f"trainer rank {rank}: the {world_size} trainer ranks did not all join the process group at "
            f"{where} within {GROUP_JOIN_TIMEOUT_S}s ({' '.join(str(err).split())[:200]})"
        ) from err
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


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
        _join_group(backend, init_method, rank, world_size)
        owns = True
    elif dist.get_world_size() != world_size:
        raise ConfigError(
            f"training.world_size={world_size} but the running process group has {dist.get_world_size()} ranks"
        )
    host_group = dist.new_group(backend="gloo") if backend == "nccl" and world_size > 1 else None
    return DistContext(dist.get_rank(), world_size, dev, owns, host_group)


def _listening_store(world_size: int, timeout: timedelta) -> dist.Store | None:
    """Rank 0's rendezvous store, served on the socket the trainer role already listens on
    (`HPCTOOLKIT_RENDEZVOUS_FD`, on the data-plane address); None without one. torch's own env://
    store listens on all interfaces whatever MASTER_ADDR says."""
    fd = envs.get(envs.HPCTOOLKIT_RENDEZVOUS_FD.name)
    if not fd:
        return None
    # Taken once: a second group in this process must not serve on the same descriptor.
    os.environ.pop(envs.HPCTOOLKIT_RENDEZVOUS_FD.name, None)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=True,
        timeout=timeout,
        master_listen_fd=int(fd),
    )
    # What env:// does to the store it makes; the other ranks join through env:// and expect it.
    return dist.PrefixStore("default_pg", store)


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


def allow_recompiles(cfg: TrainingConfig) -> None:
    """Let every compiled frame keep a compilation per batch length: `compile_lengths + 1` lengths
    (`batch.padded_length`), twice over for a short last batch of an epoch, and torch's own 8 for
    the rest. Past the limit torch runs a new shape eager, silently but for one warning."""
    # Here: torch._dynamo takes half a second to import, and only a compiled trainer calls this.
    import torch._dynamo

    want = 2 * (cfg.compile_lengths + 1) + 8
    conf = torch._dynamo.config
    conf.recompile_limit = max(conf.recompile_limit, want)
    conf.accumulated_recompile_limit = max(conf.accumulated_recompile_limit, 8 * want)


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


def _cast_floating(x: Any, dtype: torch.dtype) -> Any:
    """`x` with every floating tensor in it (through tuples and lists) cast to `dtype`, as FSDP2
    casts a module's forward inputs."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if torch.is_floating_point(x) and x.dtype != dtype else x
    if isinstance(x, (tuple, list)):
        return type(x)(_cast_floating(v, dtype) for v in x)
    return x


_compiled_upcast: Any = None


def upcast(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`g.to(dtype)`, exactly; a bf16 -> fp32 cast on CUDA through one compiled (vectorised)
    kernel. PyTorch's dtype-changing copy runs its unrolled kernel there: the K3 draft's gradient
    casts took 10.9 ms a step on an H200 where copy speed gives 4 (`benchmarks/train_k3_gpu.py`)."""
    global _compiled_upcast
    if g.device.type != "cuda" or dtype != torch.float32 or g.dtype != torch.bfloat16:
        return g.to(dtype)
    if _compiled_upcast is None:
        _compiled_upcast = torch.compile(_to_fp32, dynamic=True)
    return _compiled_upcast(g.reshape(-1)).view(g.shape)


def _to_fp32(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


class LocalMixedPrecision:
    """One rank's FSDP2 step without FSDP (see module doc): fp32 parameters, bf16 compute.

    A forward pre-hook on the trainer casts every trainable fp32 parameter into its persistent
    bf16 twin (one copy kernel per tensor) and registers the twins in the modules in their place;
    a post-accumulate-grad hook on each twin casts its gradient to fp32 into the fp32 parameter's
    `.grad` (adding, as FSDP accumulates) and drops the bf16 one; once backward ends, the fp32
    parameters are registered again. Checkpointed layers recompute with the twins still in place.
    A forward without autograd (evaluation) restores the fp32 parameters when it returns.
    """

    # Gradients cast by `upcast` on CUDA (the benchmark turns it off to compare).
    compiled_grad_cast = True
    # Set by `mixed_adamw.MixedAdamW`: each twin keeps its bf16 gradient (no fp32 `.grad`), and the
    # optimizer, which reads them, writes the twins itself (`twins_current`: no cast before forward).
    keep_low_precision_grads = False

    def __init__(self, trainer: nn.Module, units: list[nn.Module], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.slots: list[tuple[nn.Module, str, nn.Parameter, nn.Parameter]] = []
        twins: dict[int, nn.Parameter] = {}
        for module in trainer.modules():
            for name, p in list(module._parameters.items()):
                if p is None or not p.requires_grad or not torch.is_floating_point(p):
                    continue
                if id(p) not in twins:
                    twin = nn.Parameter(torch.empty_like(p, dtype=dtype), requires_grad=True)
                    twin.register_post_accumulate_grad_hook(self._grad_hook(p))
                    twins[id(p)] = twin
                self.slots.append((module, name, p, twins[id(p)]))
        self.pairs = [(p, twins[id(p)]) for p in {id(p): p for _, _, p, _ in self.slots}.values()]
        self.twin_of = dict(self.pairs)
        self.active = False
        self.callback_queued = False
        self.twins_current = False
        self.held: dict[nn.Parameter, torch.Tensor] = {}
        trainer.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        # Loaded weights (a resume) are cast into the twins again before the next forward.
        trainer.register_load_state_dict_post_hook(lambda module, keys: self._stale())
        trainer.register_forward_hook(self._post_forward)
        for unit in units:
            unit.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)

    def _stale(self) -> None:
        self.twins_current = False

    def _cast_inputs(self, module, args, kwargs):
        return _cast_floating(args, self.dtype), {k: _cast_floating(v, self.dtype) for k, v in kwargs.items()}

    def _pre_forward(self, module, args, kwargs):
        if not self.active:
            if not self.twins_current:
                with torch.no_grad():
                    for p, twin in self.pairs:
                        twin.copy_(p)
            self.twins_current = False  # only an optimizer step that writes them sets it again
            self._register(twin=True)
        return self._cast_inputs(module, args, kwargs)

    def _post_forward(self, module, args, output):
        if not torch.is_grad_enabled():
            self._register(twin=False)

    def _register(self, *, twin: bool) -> None:
        for module, name, p, t in self.slots:
            module._parameters[name] = t if twin else p
        self.active = twin

    def _grad_hook(self, p: nn.Parameter):
        def hook(twin: torch.Tensor) -> None:
            assert twin.grad is not None
            if not self.callback_queued:
                self.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            g, twin.grad = twin.grad, None
            if self.keep_low_precision_grads and p not in self.held:
                self.held[p] = g  # the one contribution, kept in bf16
                return
            cast = (lambda t: upcast(t, p.dtype)) if self.compiled_grad_cast else (lambda t: t.to(p.dtype))
            if self.keep_low_precision_grads:  # a second contribution: summed in fp32, as in `.grad`
                self.held[p] = cast(self.held[p]) + cast(g)
            else:
                p.grad = cast(g) if p.grad is None else p.grad + cast(g)

        return hook

    def low_precision_grads(self) -> dict[nn.Parameter, tuple[torch.Tensor, nn.Parameter]]:
        """fp32 parameter -> (its gradient as backward left it: bf16, or fp32 where backward
        accumulated it more than once, the twin), for those that have one."""
        return {p: (g, self.twin_of[p]) for p, g in self.held.items()}

    def drop_low_precision_grads(self, *, twins_current: bool = False) -> None:
        self.held.clear()
        self.twins_current = twins_current

    def _end_backward(self) -> None:
        self.callback_queued = False
        self._register(twin=False)


def shard_trainer(
    trainer: FamilyTrainer, mesh: DeviceMesh, cfg: TrainingConfig, *, fsdp_on_one_rank: bool = False
) -> FamilyTrainer:
    """Checkpoint, compile, then `fully_shard` every decoder layer and the root (see module doc).

    The target head is buffers only, so FSDP leaves it whole on every rank. On a mesh of one rank
    `LocalMixedPrecision` stands in for FSDP (bf16) or nothing does (fp32), unless
    `fsdp_on_one_rank` (the tests that hold the two to the same step).
    """
    units = trainer.shard_units()
    apply_activation_checkpointing(trainer, cfg.activation_checkpoint_layers)
    if compile_enabled(cfg):
        allow_recompiles(cfg)
        compile_draft = getattr(trainer.draft, "compile_layers", None)
        if compile_draft is not None:
            compile_draft()
        else:
            for unit in units:
                unit.compile(dynamic=False)
    frozen = freeze_to_compute_dtype(trainer, cfg)
    policy = mp_policy(cfg)
    if mesh.size() == 1 and not fsdp_on_one_rank:
        if policy.param_dtype is not None:
            trainer._local_mixed_precision = LocalMixedPrecision(trainer, units, policy.param_dtype)  # type: ignore[assignment]
        return trainer
    reshard = mesh.size(mesh.ndim - 1) > 1
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard, ignored_params=frozen)
    fully_shard(trainer, mesh=mesh, mp_policy=policy, ignored_params=frozen)
    return trainer
