"""Typed config of the cluster section (`cluster.*`): where the job's parts are placed."""

from __future__ import annotations

from dataclasses import dataclass

from hpctoolkit.config.fields import one_of, positive, require


@dataclass
class ClusterConfig:
    # "local": everything on this machine, no Slurm. "slurm": sbatch / submitit.
    backend: str = "local"
    nodes: int = 1
    gpus_per_node: int = 8
    # Nodes (of `nodes`) reserved for FSDP trainers; the rest host engines. The Mooncake master
    # runs on the first trainer node.
    trainer_nodes: int = 1
    partition: str | None = None
    account: str | None = None
    time: str = "04:00:00"
    job_name: str = "hpctoolkit"
    # Apptainer image (.sif). Unset on the local backend.
    container: str | None = None
    # Extra `#SBATCH` lines, e.g. ["--exclusive", "--qos=high"].
    sbatch_extra: list[str] | None = None

    def validate(self) -> None:
        one_of(self, "backend", ("local", "slurm"))
        positive(self, "nodes", "gpus_per_node", "trainer_nodes")
        require(
            self.trainer_nodes <= self.nodes,
            "trainer_nodes",
            f"must be <= nodes={self.nodes}",
            self.trainer_nodes,
        )
        if self.backend == "slurm":
            require(self.container is not None, "container", "must name the Apptainer image on slurm", None)
