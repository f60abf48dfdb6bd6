"""Which pipeline stage owns which capture id.

`pp_partition` reproduces `vllm.distributed.utils.get_pp_indices` (tests compare the two for every
layer count up to 128 and every pipeline size up to 16) so that this module stays importable where
vLLM is not installed. `VLLM_PP_LAYER_PARTITION` is honoured exactly as vLLM honours it.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

from hpctoolkit.errors import ConfigError

PARTITION_ENV = "VLLM_PP_LAYER_PARTITION"
_FROM_ENV = object()


def _parse_partition(spec: str | Sequence[int], num_layers: int, pp_size: int) -> list[int]:
    if isinstance(spec, str):
        try:
            parts = [int(x) for x in spec.split(",")]
        except ValueError as err:
            raise ConfigError(f"{PARTITION_ENV}={spec!r} is not a comma-separated list of integers") from err
    else:
        parts = [int(x) for x in spec]
    if len(parts) != pp_size:
        raise ConfigError(f"{PARTITION_ENV} has {len(parts)} entries but pp_size is {pp_size}")
    if sum(parts) != num_layers:
        raise ConfigError(f"{PARTITION_ENV} sums to {sum(parts)} but the target has {num_layers} layers")
    if any(p < 1 for p in parts):
        raise ConfigError(f"{PARTITION_ENV}={parts} gives a stage no layers")
    return parts


def pp_partition(num_layers: int, pp_size: int, partition: object = _FROM_ENV) -> list[int]:
    """Layers per stage, as vLLM splits them.

    `partition` overrides the split (a list or vLLM's comma string); by default the
    `VLLM_PP_LAYER_PARTITION` environment variable is read, as vLLM does.
    """
    if pp_size < 1:
        raise ConfigError(f"pp_size must be >= 1, got {pp_size}")
    if num_layers < pp_size:
        raise ConfigError(f"pp_size={pp_size} exceeds the target's {num_layers} layers")
    if partition is _FROM_ENV:
        partition = os.environ.get(PARTITION_ENV)
    if partition is not None:
        if not isinstance(partition, (str, Sequence)):
            raise ConfigError(f"a PP layer partition is a list or a comma string, got {partition!r}")
        return _parse_partition(partition, num_layers, pp_size)
    per, rem = divmod(num_layers, pp_size)
    parts = [per] * pp_size
    # vLLM gives the remainder to the stages before the last, walking backwards from the
    # second-to-last, because the last stage also carries the final norm and lm_head.
    for i in range(2, rem + 2):
        parts[-i] += 1
    return parts


def pp_range(num_layers: int, pp_rank: int, pp_size: int, partition: object = _FROM_ENV) -> tuple[int, int]:
    """Half-open layer range `[start, end)` of stage `pp_rank`."""
    if not 0 <= pp_rank < pp_size:
        raise ConfigError(f"pp_rank={pp_rank} is outside [0, {pp_size})")
    parts = pp_partition(num_layers, pp_size, partition)
    start = sum(parts[:pp_rank])
    return start, start + parts[pp_rank]


def stage_of(capture_id: int, num_layers: int, pp_size: int, partition: object = _FROM_ENV) -> int:
    """The stage that produces capture id `capture_id`.

    Capture id `k` is the state after layer `k-1`, so it belongs to the owner of layer `k-1`
    (`start < k <= end`); id 0, the embeddings, belongs to stage 0.
    """
    if not 0 <= capture_id <= num_layers:
        raise ConfigError(f"capture id {capture_id} is outside [0, {num_layers}]")
    if capture_id == 0:
        return 0
    parts = pp_partition(num_layers, pp_size, partition)
    end = 0
    for rank, n in enumerate(parts):
        end += n
        if capture_id <= end:
            return rank
    raise AssertionError("unreachable: capture id within [1, num_layers] always has an owner")


def owned_layers(
    layer_ids: Sequence[int], num_layers: int, pp_rank: int, pp_size: int, partition: object = _FROM_ENV
) -> list[int]:
    """The capture ids in `layer_ids` that stage `pp_rank` produces, in the given order."""
    start, end = pp_range(num_layers, pp_rank, pp_size, partition)
    return [k for k in layer_ids if start < k <= end or (k == 0 and pp_rank == 0)]


def stages_without_capture(
    layer_ids: Sequence[int], num_layers: int, pp_size: int, partition: object = _FROM_ENV
) -> list[int]:
    """Stages that own none of `layer_ids`.

    Each stage's connector binds exactly one cache-only layer, sized to the ids it owns, so a
    stage owning none has nothing to bind and the engine could not start; this names it first.
    """
    parts = pp_partition(num_layers, pp_size, partition)
    return [r for r in range(pp_size) if not owned_layers(layer_ids, num_layers, r, pp_size, parts)]


def check_every_stage_captures(
    layer_ids: Sequence[int], num_layers: int, pp_size: int, partition: object = _FROM_ENV
) -> None:
    parts = pp_partition(num_layers, pp_size, partition)
    idle = stages_without_capture(layer_ids, num_layers, pp_size, parts)
    if idle:
        ranges = ", ".join(f"stage {r} owns layers [{sum(parts[:r])}, {sum(parts[: r + 1])})" for r in idle)
        raise ConfigError(
            f"capture ids {list(layer_ids)} leave PP stage(s) {idle} with nothing to capture ({ranges}); "
            f"choose target_layer_ids so that every stage owns one, or move the split with {PARTITION_ENV}"
        )


def check_layer_layout(layer_ids: Sequence[int], num_layers: int) -> None:
    """Reject a capture-id list that would make the exported layout depend on the pipeline size.

    The list must be non-empty, strictly ascending (so no duplicates), within `[0, num_layers]`,
    and end with `num_layers`, the id the engine appends for `last_hidden_states`.
    """
    ids = list(layer_ids)
    if not ids:
        raise ConfigError("capture layer ids are empty: at least the final layer must be captured")
    dupes = sorted({k for k in ids if ids.count(k) > 1})
    if dupes:
        raise ConfigError(f"capture layer ids {ids} contain duplicates {dupes}")
    if any(b <= a for a, b in itertools.pairwise(ids)):
        raise ConfigError(f"capture layer ids {ids} are not strictly ascending")
    if ids[0] < 0:
        raise ConfigError(f"capture layer ids {ids} contain a negative id")
    if ids[-1] != num_layers:
        raise ConfigError(
            f"final capture id {ids[-1]} differs from the target's layer count {num_layers}; "
            "the last id must be the final layer (last_hidden_states)"
        )


def capture_ids_for(target_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Capture ids for a draft's 0-based `target_layer_ids`: the +1 shift, then the final layer."""
    ids = [int(i) + 1 for i in target_layer_ids] + [num_layers]
    if any(i < 0 or i >= num_layers - 1 for i in target_layer_ids):
        raise ConfigError(
            f"target_layer_ids {list(target_layer_ids)} must lie in [0, {num_layers - 2}] for a "
            f"{num_layers}-layer target (the final layer is captured separately as last_hidden_states)"
        )
    check_layer_layout(ids, num_layers)
    return ids
