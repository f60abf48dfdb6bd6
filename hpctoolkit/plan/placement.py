"""Where every process of a run starts: the placement plan. Pure (no subprocess, torch, vLLM).

`make_plan(cfg)` turns the recipe's `engine`, `training`, `store` and `cluster` sections into a
`Plan`: the Mooncake master, every engine node (vLLM `node_rank`, GPUs, the PP stage each GPU
serves) and every trainer rank, each on a node *index* of the allocation. Host names are not known
until Slurm allocates; the batch script and `hpctoolkit.roles` map index i to the i-th host of
`scontrol show hostnames $SLURM_JOB_NODELIST`. On the local backend every node is `localhost`.

Layout on Slurm (nodes numbered from 0):

* trainer nodes first (`cluster.trainer_nodes` of them); the Mooncake master runs on node 0, so the
  control plane shares the node that runs the batch script;
* then engine e's nodes, `engine.nnodes` each: node_rank 0 (the leader, which owns the scheduler
  and EngineCore) first, then its headless followers.

Every engine node takes a whole node: vLLM's multi-node executor runs one process per node that
owns `engine.gpus_per_node` GPUs from index 0. vLLM numbers ranks TP-innermost
(rank = pp_rank * tp + tp_rank, node_rank k holding ranks k*g .. k*g+g-1), which fixes the stage of
each GPU.

Where every listener binds (its node's data-plane address), which ports are picked at start and
the rule that no two named ports clash live in `plan.ports`.

The plan is a control-plane record: metadata only, frozen, and `to_dict()` is JSON-ready. Its
`digest()` is baked into rendered batch scripts so a node refuses to run a stale script.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.ports import (
    PICKED,
    MasterPlacement,
    check_ports,
    place_master,
)

if TYPE_CHECKING:
    from hpctoolkit.plan.config import RecipeSections

ROLE_MASTER = "master"
ROLE_ENGINE_LEADER = "engine-leader"
ROLE_ENGINE_FOLLOWER = "engine-follower"
ROLE_TRAINER = "trainer"
ROLES = (ROLE_MASTER, ROLE_ENGINE_LEADER, ROLE_ENGINE_FOLLOWER, ROLE_TRAINER)
# Not placed: with `evaluate.enabled` it runs once the trainers ended, on trainer rank 0's node.
ROLE_EVALUATE = "evaluate"

LOCALHOST = "localhost"


@dataclass(frozen=True)
class EngineNode:
    node: int
    node_rank: int
    gpus: tuple[int, ...]
    # The PP stage each GPU in `gpus` serves (same order).
    stages: tuple[int, ...]

    @property
    def role(self) -> str:
        return ROLE_ENGINE_LEADER if self.node_rank == 0 else ROLE_ENGINE_FOLLOWER

    @property
    def pp_stages(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.stages)))


@dataclass(frozen=True)
class EnginePlacement:
    index: int
    nnodes: int
    tp: int
    pp: int
    # A multi-node engine's vLLM rendezvous listens on its leader's node, on a port picked at
    # start (`plan.ports`).
    nodes: tuple[EngineNode, ...]

    @property
    def leader(self) -> EngineNode:
        return self.nodes[0]

    @property
    def followers(self) -> tuple[EngineNode, ...]:
        return self.nodes[1:]

    @property
    def world_size(self) -> int:
        return self.tp * self.pp


@dataclass(frozen=True)
class TrainerRank:
    rank: int
    node: int
    local_rank: int
    # None when training runs on CPU (gloo).
    gpu: int | None


@dataclass(frozen=True)
class TrainerPlacement:
    nodes: tuple[int, ...]
    world_size: int
    ranks_per_node: int
    fsdp_mode: str
    device: str
    # The torch.distributed rendezvous (several ranks) listens on the first trainer node, on a
    # port picked at start (`plan.ports`).
    ranks: tuple[TrainerRank, ...]


@dataclass(frozen=True)
class Process:
    """One process to start; `Plan.processes()` lists them in start order."""

    role: str
    node: int
    gpus: tuple[int, ...]
    engine: int | None = None
    # vLLM node_rank for engine roles, global FSDP rank for trainers.
    node_rank: int | None = None
    local_rank: int | None = None


@dataclass(frozen=True)
class Plan:
    backend: str
    num_nodes: int
    gpus_per_node: int
    # One entry per node index: "localhost" on the local backend, None on Slurm (the allocation
    # names them).
    hosts: tuple[str | None, ...]
    master: MasterPlacement | None
    # host:port of an external master when the recipe names one (store.master_address).
    external_master: str | None
    engines: tuple[EnginePlacement, ...]
    trainer: TrainerPlacement

    # ------------------------------------------------------------------ queries
    @property
    def engine_gpus(self) -> int:
        return sum(len(n.gpus) for e in self.engines for n in e.nodes)

    @property
    def trainer_gpus(self) -> int:
        return sum(1 for r in self.trainer.ranks if r.gpu is not None)

    @property
    def total_gpus(self) -> int:
        """GPUs the plan uses (the allocation may hold idle ones; see `idle_gpus`)."""
        return self.engine_gpus + self.trainer_gpus

    @property
    def allocated_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node if self.backend == "slurm" else self.total_gpus

    @property
    def idle_gpus(self) -> int:
        return self.allocated_gpus - self.total_gpus

    def processes(self) -> tuple[Process, ...]:
        procs: list[Process] = []
        if self.master is not None:
            procs.append(Process(ROLE_MASTER, self.master.node, ()))
        for e in self.engines:
            procs.extend(Process(n.role, n.node, n.gpus, e.index, n.node_rank) for n in e.nodes)
        procs.extend(
            Process(ROLE_TRAINER, r.node, () if r.gpu is None else (r.gpu,), None, r.rank, r.local_rank)
            for r in self.trainer.ranks
        )
        return tuple(procs)

    def on_node(self, node: int) -> tuple[Process, ...]:
        return tuple(p for p in self.processes() if p.node == node)

    def engine_node(self, node: int) -> tuple[EnginePlacement, EngineNode] | None:
        for e in self.engines:
            for n in e.nodes:
                if n.node == node:
                    return e, n
        return None

    def max_processes_per_node(self) -> int:
        return max(len(self.on_node(i)) for i in range(self.num_nodes))

    # ------------------------------------------------------------------ records
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["totals"] = {
            "nodes": self.num_nodes,
            "gpus": self.total_gpus,
            "engine_gpus": self.engine_gpus,
            "trainer_gpus": self.trainer_gpus,
            "allocated_gpus": self.allocated_gpus,
        }
        return d

    def digest(self) -> str:
        """A short fingerprint of the placement; a rendered script carries it."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def host_label(self, node: int) -> str:
        host = self.hosts[node]
        return f"n{node}" if host is None else f"n{node}={host}"

    def describe(self) -> str:
        unit = "GPU(s)" if self.backend == "slurm" else "device slot(s)"
        lines = [
            f"placement   {self.backend}: {self.num_nodes} node(s), {self.total_gpus} {unit} used "
            f"({self.engine_gpus} engine + {self.trainer_gpus} trainer)"
            + (f", {self.idle_gpus} idle" if self.idle_gpus else ""),
        ]
        if self.backend == "slurm":
            lines.append("            node nK = K-th host of the allocation (scontrol show hostnames)")
        rows = [("role", "node", "engine", "node_rank", "gpus", "pp stages / ranks")]
        if self.master is not None:
            rows.append((ROLE_MASTER, self.host_label(self.master.node), "-", "-", "-", self.master.rule))
        for e in self.engines:
            for n in e.nodes:
                rows.append(
                    (
                        n.role,
                        self.host_label(n.node),
                        str(e.index),
                        str(n.node_rank),
                        span(n.gpus),
                        "stage " + ",".join(map(str, n.pp_stages)) + f"  (TP={e.tp} PP={e.pp})",
                    )
                )
        t = self.trainer
        for node in t.nodes:
            ranks = [r for r in t.ranks if r.node == node]
            gpus = tuple(r.gpu for r in ranks if r.gpu is not None)
            rows.append(
                (
                    ROLE_TRAINER,
                    self.host_label(node),
                    "-",
                    "-",
                    span(gpus) if gpus else t.device,
                    f"ranks {span(tuple(r.rank for r in ranks))} of {t.world_size}  (FSDP {t.fsdp_mode})",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
        if self.external_master:
            lines.append(f"  mooncake master: external at {self.external_master}")
        for e in (e for e in self.engines if e.nnodes > 1):
            lines.append(
                f"  engine {e.index} rendezvous: data-plane address of {self.host_label(e.leader.node)}, "
                f"port {PICKED} (ports/engine{e.index}.json)"
            )
        if t.world_size > 1:
            lines.append(
                f"  trainer rendezvous: data-plane address of {self.host_label(t.nodes[0])}, "
                f"port {PICKED} (ports/trainers.json)"
            )
        return "\n".join(lines)


def span(values: Sequence[int]) -> str:
    """`0-7` for a contiguous run, else `0,2,5` (`-` for none): GPU and rank lists, as people read them."""
    if not values:
        return "-"
    if len(values) > 1 and list(values) == list(range(values[0], values[0] + len(values))):
        return f"{values[0]}-{values[-1]}"
    return ",".join(map(str, values))


def _engine_nodes(tp: int, nnodes: int, gpn: int, first_node: int) -> tuple[EngineNode, ...]:
    nodes = []
    for k in range(nnodes):
        ranks = range(k * gpn, (k + 1) * gpn)
        nodes.append(
            EngineNode(
                node=first_node + k,
                node_rank=k,
                gpus=tuple(range(gpn)),
                stages=tuple(r // tp for r in ranks),
            )
        )
    return tuple(nodes)


def _check_degrees(cfg: RecipeSections) -> None:
    """Placement's own rule on the engine degrees (that pp divides the engine's world is the engine
    section's, checked when the recipe loads)."""
    e = cfg.engine
    tp, g = e.tp_size, e.gpus_per_node
    # A TP group either fits inside one node or spans whole nodes; a group straddling a node
    # boundary part-way puts the per-layer all-reduce on the inter-node link for some ranks only.
    if tp % g and g % tp:
        raise ConfigError(
            f"engine.pp_size={e.pp_size} gives TP={tp}, which neither divides nor is a multiple of "
            f"engine.gpus_per_node={g}: a tensor-parallel group would straddle a node boundary"
        )


def make_plan(cfg: RecipeSections) -> Plan:
    """Place the master, the engines and the trainers; raise `ConfigError` naming the key when the
    cluster cannot hold the job."""
    _check_degrees(cfg)
    c, e, t = cfg.cluster, cfg.engine, cfg.training
    if c.backend == "local":
        return _local_plan(cfg)

    gpn = c.gpus_per_node
    if e.gpus_per_node > gpn:
        raise ConfigError(
            f"engine.gpus_per_node={e.gpus_per_node} exceeds cluster.gpus_per_node={gpn}: "
            "an engine node runs on one Slurm node"
        )
    # training.device=cpu: gloo ranks that take no GPU (a CPU-only site, or the emulated cluster
    # of launch/local_slurm.sh); they still run per_node to a trainer node.
    on_gpu = t.device == "cuda"
    if t.world_size % c.trainer_nodes:
        raise ConfigError(
            f"training.world_size={t.world_size} must be a multiple of cluster.trainer_nodes={c.trainer_nodes} "
            "(every trainer node runs the same number of FSDP ranks)"
        )
    per_node = t.world_size // c.trainer_nodes
    # Trainers on engine nodes take the GPUs the engine leaves (cluster.trainer_placement).
    shared = c.trainer_placement == "engine_nodes"
    free = gpn - e.gpus_per_node if shared else gpn
    if on_gpu and per_node > free:
        raise ConfigError(
            f"training.world_size={t.world_size} needs {per_node} GPUs on each of cluster.trainer_nodes="
            f"{c.trainer_nodes} node(s), but cluster.gpus_per_node={gpn}"
            + (f" leaves {free} beside engine.gpus_per_node={e.gpus_per_node}" if shared else "")
            + "; raise cluster.trainer_nodes"
        )
    if shared and c.trainer_nodes > e.num_engines * e.nnodes:
        raise ConfigError(
            f"cluster.trainer_nodes={c.trainer_nodes} exceeds the {e.num_engines * e.nnodes} engine node(s) "
            "the trainers share (cluster.trainer_placement=engine_nodes)"
        )
    own = 0 if shared else c.trainer_nodes
    needed = own + e.num_engines * e.nnodes
    if c.nodes != needed:
        why = "too few" if c.nodes < needed else "more than the placement uses (the rest would sit idle)"
        raise ConfigError(
            f"cluster.nodes={c.nodes} is {why}: {own} trainer node(s) + {e.num_engines} engine(s) "
            f"x {e.nnodes} node(s) = {needed}; set cluster.nodes={needed}"
        )

    trainer = _slurm_trainer(cfg, per_node, first_gpu=gpn - free)
    engines = tuple(
        EnginePlacement(
            index=i,
            nnodes=e.nnodes,
            tp=e.tp_size,
            pp=e.pp_size,
            nodes=_engine_nodes(e.tp_size, e.nnodes, e.gpus_per_node, own + i * e.nnodes),
        )
        for i in range(e.num_engines)
    )
    master, external = place_master(cfg.store, 0, local=False)
    plan = Plan("slurm", needed, gpn, (None,) * needed, master, external, engines, trainer)
    _check_ports(plan, cfg)
    _assert_consistent(plan)
    return plan


def _slurm_trainer(cfg: RecipeSections, per_node: int, first_gpu: int) -> TrainerPlacement:
    """`per_node` ranks on each of the first `cluster.trainer_nodes` nodes, on the GPUs from
    `first_gpu` (none with training.device=cpu)."""
    t = cfg.training
    on_gpu = t.device == "cuda"
    ranks = tuple(
        TrainerRank(
            rank=r,
            node=r // per_node,
            local_rank=r % per_node,
            gpu=first_gpu + r % per_node if on_gpu else None,
        )
        for r in range(t.world_size)
    )
    nodes = tuple(range(cfg.cluster.trainer_nodes))
    return TrainerPlacement(nodes, t.world_size, per_node, t.fsdp_mode, t.device, ranks)


def _local_plan(cfg: RecipeSections) -> Plan:
    """Everything on this machine: node index 0 is `localhost`. Engine workers and CUDA trainers
    draw device indices from one pool of `cluster.gpus_per_node` (on a CPU-only machine they are
    worker slots, not GPUs)."""
    c, e, t = cfg.cluster, cfg.engine, cfg.training
    pool = c.gpus_per_node
    next_gpu = 0
    engines = []
    for i in range(e.num_engines):
        nodes = []
        for k in range(e.nnodes):
            world_ranks = range(k * e.gpus_per_node, (k + 1) * e.gpus_per_node)
            gpus = tuple(range(next_gpu, next_gpu + e.gpus_per_node))
            next_gpu += e.gpus_per_node
            nodes.append(EngineNode(0, k, gpus, tuple(r // e.tp_size for r in world_ranks)))
        engines.append(EnginePlacement(i, e.nnodes, e.tp_size, e.pp_size, tuple(nodes)))
    on_gpu = t.device == "cuda"
    ranks: list[TrainerRank] = []
    for r in range(t.world_size):
        ranks.append(TrainerRank(r, 0, r, next_gpu if on_gpu else None))
        next_gpu += 1 if on_gpu else 0
    if next_gpu > pool:
        raise ConfigError(
            f"cluster.gpus_per_node={pool} is too few for the local backend: the engines take "
            f"{e.num_engines * e.world_size} device(s) and the trainers {t.world_size if on_gpu else 0}"
        )
    trainer = TrainerPlacement((0,), t.world_size, t.world_size, t.fsdp_mode, t.device, tuple(ranks))
    master, external = place_master(cfg.store, 0, local=True)
    plan = Plan("local", 1, pool, (LOCALHOST,), master, external, tuple(engines), trainer)
    _check_ports(plan, cfg)
    _assert_consistent(plan)
    return plan


def _check_ports(plan: Plan, cfg: RecipeSections) -> None:
    """The ports the recipe names do not clash (`ports.check_ports`); the others are picked at start."""
    if plan.master is not None:
        m, metrics = plan.master, cfg.store.metrics_port
        check_ports(
            [
                (m.node, m.port, f"the Mooncake master (store.master_port={m.port})"),
                (m.node, metrics, f"its metrics (store.metrics_port={metrics})"),
            ]
        )


def _assert_consistent(plan: Plan) -> None:
    """Internal invariants; a violation is a bug here, not a user mistake."""
    seen: set[tuple[int, int]] = set()
    for p in plan.processes():
        if not 0 <= p.node < plan.num_nodes:
            raise AssertionError(f"{p} placed outside the {plan.num_nodes} node(s)")
        for g in p.gpus:
            if (p.node, g) in seen:
                raise AssertionError(f"GPU {g} of node {p.node} placed twice")
            if not 0 <= g < plan.gpus_per_node:
                raise AssertionError(f"GPU {g} of node {p.node} outside 0..{plan.gpus_per_node - 1}")
            seen.add((p.node, g))
    for e in plan.engines:
        if e.leader.node_rank != 0 or [n.node_rank for n in e.nodes] != list(range(e.nnodes)):
            raise AssertionError(f"engine {e.index} node ranks out of order")
        stages = sorted({s for n in e.nodes for s in n.stages})
        if stages != list(range(e.pp)):
            raise AssertionError(f"engine {e.index} serves stages {stages}, want 0..{e.pp - 1}")
