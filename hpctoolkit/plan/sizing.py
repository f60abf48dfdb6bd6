"""How big the store, the spool and the nodes' memory must be for a recipe. Pure arithmetic.

Who writes what (the contract of `capture.manifest` and `engine.connector`):

* a sample is one object per capture id, `[num_tokens, hidden_size]` in `engine.dtype`, written by
  the PP stage that owns the id (`capture.layout.stage_of`), plus its `input_ids` object
  (`[num_tokens]` int64), written by stage 0; its loss mask (`[num_tokens]` uint8) is put by the
  engine leader itself, from a writer of its own with a small segment (`store.fragments.LossMasks`);
* each stage publishes from its TP rank 0 only: one store *writer* per PP stage per engine. Every
  writer mounts one segment of `store.global_segment_size` in the host memory of its node, and
  puts its fragments there (`preferred_segment`): a stage's fragments of every unread sample of its
  engine live in that stage's one segment;
* every client (the writers and one reader per trainer rank) registers `store.local_buffer_size`.

In flight. An engine leader checks its writers' unread bytes before each capture batch and pauses
while any segment is above `store.backpressure_high` of its size (resuming below
`store.backpressure_low`), so a segment holds at most the high watermark plus one capture batch
of the longest sample: `high x segment + capture_batch x longest stage bytes <= segment`. A recipe
that breaks this is refused at load, naming the numbers and the keys.

The longest sample is `data.max_prompt_tokens + data.regenerate_tokens` tokens (a row, or a
regenerated turn's history, is at most `max_prompt_tokens`; each regenerated turn adds at most
`regenerate_tokens`), and never more than `engine.max_model_len - 1`: the engine refuses a sequence
of `max_model_len` tokens or more, so nothing longer reaches the store.

Counts (`check_counts`). P = floor(data.num_samples / training.world_size) is the smallest rank's
share of one pass, C = training.steps x training.batch_size the samples each rank's steps consume,
E = training.epochs (0: derived, the passes C needs). The one relation:

    max((E - 1) x P, P - batch_size) < C <= E x P

The steps never need more than E passes (no shortfall), need the last one (E is not too large),
and read every published sample of the first pass but for less than one batch per rank (no
captured surplus). Replays (E > 1) come from the spool, bounded by `training.spool_max_size`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from hpctoolkit.capture.layout import capture_ids_for, owned_layers, pp_partition
from hpctoolkit.capture.manifest import DTYPE_BYTES
from hpctoolkit.errors import ConfigError
from hpctoolkit.targets.resolve import num_hidden_layers

if TYPE_CHECKING:
    from hpctoolkit.plan.config import RecipeSections
    from hpctoolkit.plan.placement import Plan

# Per token beside the hidden states: input_ids (int64, stage 0's writer) and the loss mask
# (uint8, the leader's mask writer).
INPUT_IDS_BYTES = DTYPE_BYTES["int64"]
LOSS_MASK_BYTES = 1
# The leader's mask writer: store.fragments.mask_segment_bytes (each mask rounded up to 4 KiB,
# twice over, at least 32 MiB) and a 16 MiB buffer (roles.engines._loss_masks).
MASK_SEGMENT_MIN = 32 << 20
MASK_BUFFER_BYTES = 16 << 20
# Mooncake's client refuses a smaller segment ("Total size must be at least 16777216").
MIN_SEGMENT_BYTES = 16 << 20


def fmt_bytes(n: float) -> str:
    """`448.0 MiB`-style: binary units, as sizes in a recipe are read (`128GB` is 2**37 bytes)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class StageSizing:
    stage: int
    capture_ids: tuple[int, ...]
    # hidden states it owns x hidden_size x dtype bytes, plus 8 (input_ids) on stage 0
    bytes_per_token: int
    longest_sample_bytes: int
    # longest samples of this stage one segment holds
    samples_per_segment: int


@dataclass(frozen=True)
class Counts:
    samples_published: int
    samples_per_rank_per_pass: int
    samples_consumed: int  # steps x batch_size x world_size
    epochs: int  # passes, the first from the store, the rest from the spool

    @property
    def spooled(self) -> bool:
        return self.epochs > 1


@dataclass(frozen=True)
class NodeMemory:
    node: int
    writers: int  # stage writers (store.global_segment_size each)
    clients: int  # every store client: stage writers, trainer readers, leaders' mask writers
    workers: int
    # stage segments + their and the readers' local buffers + the mask writer's segment and buffer
    store_bytes: int
    total_bytes: int  # store_bytes + workers x cluster.host_memory_per_worker


@dataclass(frozen=True)
class StoreSizing:
    hidden_size: int
    dtype: str
    num_layers: int
    capture_ids: tuple[int, ...]
    longest_sample_tokens: int
    longest_sample_bytes: int
    stages: tuple[StageSizing, ...]
    # store writers: one per PP stage per engine, each mounting one segment
    writers: int
    segment_bytes: int
    local_buffer_bytes: int
    store_bytes: int  # writers x segment_bytes
    high_watermark: float
    low_watermark: float
    # per engine: longest samples unread in its fullest segment at worst (pause point + a batch)
    samples_in_flight: int
    capture_batch: int
    counts: Counts
    # the spool's worst case: every rank's first pass at the longest sample, when it spools
    spool_bytes: int
    spool_max_bytes: int
    nodes: tuple[NodeMemory, ...]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        c = self.counts
        lines = [
            f"sample      longest {self.longest_sample_tokens} tokens = "
            f"{fmt_bytes(self.longest_sample_bytes)}: capture ids {list(self.capture_ids)}, hidden "
            f"{self.hidden_size} x {self.dtype} + input_ids and loss mask",
        ]
        for s in self.stages:
            lines.append(
                f"  stage {s.stage}   ids {list(s.capture_ids)}: {s.bytes_per_token} B/token, longest "
                f"{fmt_bytes(s.longest_sample_bytes)}; one segment holds {s.samples_per_segment}"
            )
        lines += [
            f"store       {self.writers} writer segment(s) x {fmt_bytes(self.segment_bytes)} "
            f"(store.global_segment_size, per writer = per PP stage per engine) = "
            f"{fmt_bytes(self.store_bytes)}; local buffer {fmt_bytes(self.local_buffer_bytes)} per client",
            f"in flight   engines pause at {self.high_watermark:g} of a segment, resume below "
            f"{self.low_watermark:g}: at most {self.samples_in_flight} longest samples unread per engine "
            f"(engine.capture_batch={self.capture_batch} past the pause point)",
            f"counts      {c.samples_published} published; steps consume {c.samples_consumed} "
            f"= {c.epochs} pass(es) of {c.samples_per_rank_per_pass} per rank",
            "spool       "
            + (
                f"{fmt_bytes(self.spool_bytes)} at most (longest samples), bound "
                f"{fmt_bytes(self.spool_max_bytes)} (training.spool_max_size)"
                if c.spooled
                else "off (one pass from the store)"
            ),
        ]
        if self.nodes:
            worst = max(self.nodes, key=lambda n: n.total_bytes)
            lines.append(
                f"memory      busiest node n{worst.node}: {worst.writers} stage segment(s), {worst.clients} "
                f"client(s) = {fmt_bytes(worst.store_bytes)} of store, {fmt_bytes(worst.total_bytes)} "
                f"with {worst.workers} worker(s)' allowance"
            )
        return "\n".join(lines)


def check_watermarks(high: float, low: float) -> None:
    if not 0 < low < high < 1:
        raise ConfigError(
            f"store.backpressure_low={low:g} and store.backpressure_high={high:g} must satisfy "
            "0 < low < high < 1 (fractions of a writer's segment)"
        )


def stage_bytes_per_token(
    capture_ids: list[int], num_layers: int, pp_size: int, hidden_size: int, dtype: str
) -> list[int]:
    """Bytes per token each PP stage publishes (its hidden states, plus input_ids on stage 0)."""
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"engine.dtype={dtype!r} has no known element size")
    parts = pp_partition(num_layers, pp_size)
    return [
        len(owned_layers(capture_ids, num_layers, s, pp_size, parts)) * hidden_size * DTYPE_BYTES[dtype]
        + (INPUT_IDS_BYTES if s == 0 else 0)
        for s in range(pp_size)
    ]


def longest_sample_tokens(cfg: RecipeSections) -> int:
    d = cfg.data
    return min(d.max_prompt_tokens + d.regenerate_tokens, cfg.engine.max_model_len - 1)


def check_counts(cfg: RecipeSections) -> Counts:
    """The counts relation of the module docstring; raises `ConfigError` with the numbers."""
    t, n = cfg.training, cfg.data.num_samples
    per_rank = n // t.world_size
    if per_rank < t.batch_size:
        raise ConfigError(
            f"data.num_samples={n} gives each of training.world_size={t.world_size} rank(s) {per_rank} "
            f"sample(s) a pass, fewer than training.batch_size={t.batch_size}; raise data.num_samples"
        )
    consumed = t.steps * t.batch_size
    need = math.ceil(consumed / per_rank)
    epochs = t.epochs or need
    one_step = t.batch_size * t.world_size
    if epochs < need:
        raise ConfigError(
            f"training.steps={t.steps} consume {consumed * t.world_size} samples, more than "
            f"training.epochs={epochs} pass(es) of data.num_samples={n} hold; set training.epochs={need}, "
            f"or training.steps={epochs * per_rank // t.batch_size}, or data.num_samples="
            f"{math.ceil(consumed / epochs) * t.world_size}"
        )
    if epochs > need:
        raise ConfigError(
            f"training.epochs={epochs} but training.steps={t.steps} end within pass {need} of "
            f"data.num_samples={n}; set training.epochs={need} (or 0: derived)"
        )
    if epochs == 1 and per_rank - consumed >= t.batch_size:
        steps = per_rank // t.batch_size
        raise ConfigError(
            f"data.num_samples={n} would publish {(per_rank - consumed) * t.world_size} or more samples "
            f"that training.steps={t.steps} x {one_step} samples a step never read (captured for nothing); set "
            f"data.num_samples={consumed * t.world_size} or training.steps={steps}"
        )
    return Counts(n, per_rank, consumed * t.world_size, epochs)


def node_memory(cfg: RecipeSections, plan: Plan) -> tuple[NodeMemory, ...]:
    """Store memory (segments + local buffers) and the workers' allowance on every node of `plan`.

    Needs no target config: the render of a batch script calls it before the paths exist.
    """
    s, e = cfg.store, cfg.engine
    seg, buf = s.global_segment_size, s.local_buffer_size
    per_worker = cfg.cluster.host_memory_per_worker or 0
    writers = [0] * plan.num_nodes
    workers = [0] * plan.num_nodes
    readers = [0] * plan.num_nodes
    for eng in plan.engines:
        for n in eng.nodes:
            workers[n.node] += len(n.gpus)
            for k in range(len(n.gpus)):
                # TP rank 0 of each stage writes (vLLM ranks are TP-innermost).
                if (n.node_rank * e.gpus_per_node + k) % eng.tp == 0:
                    writers[n.node] += 1
    # Each leader's mask writer holds the masks of its engine's share of the samples.
    masks = [0] * plan.num_nodes
    for eng in plan.engines:
        masks[eng.leader.node] += 1
    share = -(-cfg.data.num_samples // e.num_engines)
    mask_seg = max(MASK_SEGMENT_MIN, 2 * share * (-(-longest_sample_tokens(cfg) // 4096) * 4096))
    for r in plan.trainer.ranks:
        readers[r.node] += 1
        workers[r.node] += 1
    out = []
    for i in range(plan.num_nodes):
        store = writers[i] * seg + (writers[i] + readers[i]) * buf + masks[i] * (mask_seg + MASK_BUFFER_BYTES)
        clients = writers[i] + readers[i] + masks[i]
        out.append(NodeMemory(i, writers[i], clients, workers[i], store, store + workers[i] * per_worker))
    return tuple(out)


def size_store(cfg: RecipeSections, target: Mapping[str, Any], plan: Plan | None = None) -> StoreSizing:
    """The store, spool and memory figures of `cfg` against its target's HF config; raises
    `ConfigError` (numbers and the key to change) when the segments cannot hold what is in flight
    or the spool would pass its bound."""
    e, s, t = cfg.engine, cfg.store, cfg.training
    num_layers = num_hidden_layers(target)
    hidden = target.get("hidden_size")
    if not isinstance(hidden, int) or hidden < 1:
        raise ConfigError(f"paths.target_model: config has no usable hidden_size ({hidden!r})")
    check_watermarks(s.backpressure_high, s.backpressure_low)
    capture = capture_ids_for(e.target_layer_ids, num_layers)
    tokens = longest_sample_tokens(cfg)
    per_token = stage_bytes_per_token(capture, num_layers, e.pp_size, hidden, e.dtype)
    seg = s.global_segment_size
    if seg < MIN_SEGMENT_BYTES:
        raise ConfigError(
            f"store.global_segment_size={fmt_bytes(seg)} is below Mooncake's smallest segment "
            f"({fmt_bytes(MIN_SEGMENT_BYTES)}): the writer's client setup would fail"
        )
    stages = _stage_sizes(capture, num_layers, e.pp_size, per_token, tokens, seg)
    in_flight = _samples_in_flight(cfg, max(stages, key=lambda x: x.longest_sample_bytes), tokens)
    counts = check_counts(cfg)
    sample_bytes = (sum(per_token) + LOSS_MASK_BYTES) * tokens
    spool_bytes = _spool_bytes(cfg, counts, sample_bytes, t.spool_max_size)
    nodes = node_memory(cfg, plan) if plan is not None and plan.backend == "slurm" else ()
    return StoreSizing(
        hidden_size=hidden,
        dtype=e.dtype,
        num_layers=num_layers,
        capture_ids=tuple(capture),
        longest_sample_tokens=tokens,
        longest_sample_bytes=sample_bytes,
        stages=stages,
        writers=e.num_engines * e.pp_size,
        segment_bytes=seg,
        local_buffer_bytes=s.local_buffer_size,
        store_bytes=e.num_engines * e.pp_size * seg,
        high_watermark=s.backpressure_high,
        low_watermark=s.backpressure_low,
        samples_in_flight=in_flight,
        capture_batch=e.capture_batch,
        counts=counts,
        spool_bytes=spool_bytes,
        spool_max_bytes=t.spool_max_size,
        nodes=nodes,
    )


def _stage_sizes(
    capture: list[int], num_layers: int, pp_size: int, per_token: list[int], tokens: int, seg: int
) -> tuple[StageSizing, ...]:
    parts = pp_partition(num_layers, pp_size)
    return tuple(
        StageSizing(
            st,
            tuple(owned_layers(capture, num_layers, st, pp_size, parts)),
            b,
            b * tokens,
            seg // (b * tokens),
        )
        for st, b in enumerate(per_token)
    )


def _samples_in_flight(cfg: RecipeSections, worst: StageSizing, tokens: int) -> int:
    """Longest samples unread in the fullest segment at worst: the pause point plus one capture
    batch, which must fit the room above the high watermark (`ConfigError` otherwise)."""
    e, s = cfg.engine, cfg.store
    seg = s.global_segment_size
    room = seg - s.backpressure_high * seg
    batch_bytes = e.capture_batch * worst.longest_sample_bytes
    if batch_bytes > room:
        fit_batch = int(room // worst.longest_sample_bytes)
        need_seg = math.ceil(batch_bytes / (1 - s.backpressure_high))
        raise ConfigError(
            f"store.global_segment_size={fmt_bytes(seg)} cannot hold the samples in flight: stage "
            f"{worst.stage}'s writer pauses at store.backpressure_high={s.backpressure_high:g} "
            f"({fmt_bytes(s.backpressure_high * seg)}), and one more engine.capture_batch={e.capture_batch} "
            f"of its longest sample ({fmt_bytes(worst.longest_sample_bytes)} at {tokens} tokens) is {fmt_bytes(batch_bytes)} > the {fmt_bytes(room)} left; raise "
            f"store.global_segment_size to {fmt_bytes(need_seg)} or lower engine.capture_batch to "
            f"{max(fit_batch, 0)}"
        )
    return int(s.backpressure_high * seg // worst.longest_sample_bytes) + e.capture_batch


def _spool_bytes(cfg: RecipeSections, counts: Counts, sample_bytes: int, spool_max: int) -> int:
    """The spool's worst case (0 when it is off); `ConfigError` past `spool_max`."""
    t = cfg.training
    spool_bytes = 0
    if counts.spooled:
        # Every rank reads its whole share in the first pass, and keeps it.
        spool_bytes = cfg.data.num_samples * sample_bytes
    if spool_bytes > spool_max:
        raise ConfigError(
            f"training.epochs={counts.epochs} replays each rank's first pass from the spool: up to "
            f"{fmt_bytes(spool_bytes)} ({cfg.data.num_samples} samples of at most {fmt_bytes(sample_bytes)}) > "
            f"training.spool_max_size={fmt_bytes(spool_max)}; raise it, or lower training.steps to one pass "
            f"({counts.samples_per_rank_per_pass // t.batch_size})"
        )
    return spool_bytes


def check_free_space(need: int, free: int, where: str) -> None:
    """The spool's worst case (`StoreSizing.spool_bytes`) must fit in the free space of the disk
    that holds `paths.output_dir` (`where`: its nearest existing folder) at submission."""
    if need > free:
        raise ConfigError(
            f"paths.output_dir: {where} has {fmt_bytes(free)} free, and the run's spool may take "
            f"{fmt_bytes(need)} there (data.num_samples x the longest sample; see the plan's spool "
            "line): free space, point paths.output_dir at a larger disk, or train one pass "
            "(training.epochs=1 spools nothing)"
        )


def check_node_memory(nodes: tuple[NodeMemory, ...], node_memory_bytes: int, partition: str | None) -> None:
    """Refuse a plan whose busiest node needs more than the partition's nodes have (`sinfo`)."""
    worst = max(nodes, key=lambda n: n.total_bytes, default=None)
    if worst is not None and worst.total_bytes > node_memory_bytes:
        raise ConfigError(
            f"node n{worst.node} needs {fmt_bytes(worst.total_bytes)} ({worst.writers} x "
            f"store.global_segment_size + {worst.clients} x store.local_buffer_size + {worst.workers} x "
            f"cluster.host_memory_per_worker) but the nodes of partition {partition or '(default)'} have "
            f"{fmt_bytes(node_memory_bytes)} (sinfo); lower store.global_segment_size"
        )
