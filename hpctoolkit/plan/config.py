"""Typed config of the cluster section (`cluster.*`): where the job's parts are placed; and the
sections the plan reads of a recipe (`RecipeSections`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

from hpctoolkit.config.fields import (
    Bool,
    Choice,
    Int,
    Kind,
    ListOf,
    Network,
    Path,
    Size,
    SlurmText,
    SlurmTime,
    check_fields,
    require,
    slurm_time_seconds,
)

if TYPE_CHECKING:
    from hpctoolkit.data.config import DataConfig
    from hpctoolkit.engine.config import EngineConfig
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.train.config import TrainingConfig


@dataclass
class ClusterConfig:
    # "local": everything on this machine, no Slurm. "slurm": sbatch / submitit.
    backend: str = "local"
    # Slurm nodes of the job. The placement derives how many it needs (trainer_nodes +
    # engine.num_engines x engine.nnodes) and refuses any other number, so an idle node is
    # never billed by accident. Ignored on the local backend.
    nodes: int = 1
    gpus_per_node: int = 8
    # Nodes (of `nodes`) reserved for FSDP trainers; the rest host engines. The Mooncake master
    # runs on the first trainer node (node 0 of the allocation, which also runs the batch script).
    trainer_nodes: int = 1
    # "own_nodes": the trainer nodes above are their own, the engines take whole nodes after them.
    # "engine_nodes": the trainers run on the first `trainer_nodes` engine nodes, on the GPUs
    # beyond engine.gpus_per_node (`nodes` is then the engines' nodes alone; the master runs on
    # node 0, engine 0's leader). Uses partly filled nodes; costs TP crossing nodes when an
    # engine stage spans several (recipes/k3_8nodes.yaml).
    trainer_placement: str = "own_nodes"
    # Host memory each GPU worker (vLLM worker, trainer rank) needs beside the store's segments
    # and buffers, e.g. "48GB". Set: the batch script asks `--mem` for the busiest node's segments
    # + buffers + this per worker (hpctoolkit.plan.sizing.node_memory). Unset (None; "" in a
    # recipe): no `--mem`. In bytes, parsed once at load from the recipe's `48GB`.
    host_memory_per_worker: int | None = None
    partition: str | None = None
    account: str | None = None
    time: str = "04:00:00"
    job_name: str = "hpctoolkit"
    # Apptainer image (.sif) every step runs in (`apptainer exec --nv`, binding what the recipe
    # names outside the image: hpctoolkit.slurm.container). `make image` writes it to
    # hpctoolkit.slurm.container.DEFAULT_IMAGE, which recipes/k3.yaml names. Unset: steps run the
    # `python` on PATH (the emulated test cluster, or a site with a shared virtualenv).
    container: str | None = None
    # Request whole nodes (`--exclusive`): engines and trainers assume they own the node.
    exclusive: bool = True
    # Seconds of warning before the time limit: the batch shell gets SIGUSR2 and forwards it to
    # the trainers, which checkpoint (`--signal=B:USR2@N`).
    signal_before_s: int = 120
    # The data-plane network every role binds and advertises (hpctoolkit.roles.network): an
    # interface (`ib0`, `eth0`) or a CIDR (`10.1.0.0/16`). Each process finds its own address on
    # it. Unset: `lo` on the local backend; a Slurm job of several nodes must set it.
    network: str | None = None
    # Extra `#SBATCH` lines, e.g. ["--qos=high", "--constraint=h100"].
    sbatch_extra: list[str] | None = None

    # What each field accepts (`config/fields.py`): every string here reaches sbatch.
    KINDS: ClassVar[dict[str, Kind]] = {
        "backend": Choice(("local", "slurm")),
        "nodes": Int(1, 100_000),
        "gpus_per_node": Int(1, 1024),
        "trainer_nodes": Int(1, 100_000),
        "trainer_placement": Choice(("own_nodes", "engine_nodes")),
        "host_memory_per_worker": Size(empty=True, optional=True),
        "partition": SlurmText(word=True, nonempty=True, optional=True),
        "account": SlurmText(word=True, nonempty=True, optional=True),
        "time": SlurmTime(),
        "job_name": SlurmText(word=True, nonempty=True),
        "container": Path(nonempty=True, optional=True),
        "exclusive": Bool(),
        "signal_before_s": Int(1, 365 * 24 * 3600),
        "network": Network(optional=True),
        "sbatch_extra": ListOf(SlurmText(nonempty=True), optional=True),
    }

    def validate(self) -> None:
        check_fields(self)
        limit_s = slurm_time_seconds(self.time, "time")
        require(
            self.signal_before_s < limit_s,
            "signal_before_s",
            f"must be shorter than the time limit time={self.time!r} ({limit_s} s)",
            self.signal_before_s,
        )
        require(
            self.trainer_nodes <= self.nodes,
            "trainer_nodes",
            f"must be <= nodes={self.nodes}",
            self.trainer_nodes,
        )
        require(
            self.network is not None or self.backend == "local" or self.nodes == 1,
            "network",
            "must name the data-plane network of a job of several nodes: an interface every node "
            "has (ib0, eth0) or a CIDR (10.1.0.0/16)",
            self.network,
        )
        for line in self.sbatch_extra or []:
            require(
                line.startswith("--") and "\n" not in line,
                "sbatch_extra",
                "entries must be single long options like --qos=high",
                line,
            )


class RecipeSections(Protocol):
    """The sections of a recipe that the placement and the sizing read. The recipe type that
    assembles them (`recipe.schema.RecipeConfig`) stands above plan/, so plan/ names what it
    reads here instead of importing it."""

    @property
    def cluster(self) -> ClusterConfig: ...
    @property
    def data(self) -> DataConfig: ...
    @property
    def engine(self) -> EngineConfig: ...
    @property
    def store(self) -> StoreConfig: ...
    @property
    def training(self) -> TrainingConfig: ...
