"""Prefill batches of a capture engine: which prompts share one `generate()` call, and the
scheduler-side gate that makes vLLM run each such batch as one engine step. Pure (no vLLM import).

Why fixed batches: batch composition changes GEMM shapes and hence the low bits of the hidden
states (bf16: 1-2 ULP; spec notes, 000_e1aa565cc1213e2e.txt), while PP itself does not. With
`engine.prefill_batch = B` a sample at engine-local position `p` (its place among the engine's
prompts) is always prefilled with the other prompts of batch `p // B`, whatever the layout, so a
re-run or a PP=2 run reproduces a PP=1 run's bits. A resumed run whose checkpoint trained only
part of a batch prefills that batch's remaining prompts together: as deterministic, and as
layout-free, but not bitwise the first attempt's capture of them (which was never trained on).

Why a gate: `generate()` adds its requests one message at a time; a multiprocess EngineCore (every
PP engine) may schedule a step after the first arrived, and a batch would be cut by timing. Each
request of a batch carries `GROUP_PARAM: [group id, size]` in its `kv_transfer_params`; the
connector asks `PrefillGate.admit` from `get_num_new_matched_tokens` and answers vLLM "not yet"
(None: the request stays waiting, in order) until the scheduler has seen every request of the
group in an earlier pass. The pass that completes a group holds it too (`end_pass` releases it),
so the whole group is admitted in the next pass, together. `engine.kwargs` sizes the token and
sequence budgets so that such a pass can take all of it. Without the gate a PP=2 engine on the CPU
split batches of 3 by timing in 2 of 2 runs (2026-12-07, `tests/e2e/test_vllm_pp_equivalence.py`
with `admit` returning True); with it, every batch ran as one step in both layouts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hpctoolkit.errors import DataIntegrityError

# kv_transfer_params key of a request that belongs to a prefill batch: [group id, group size].
GROUP_PARAM = "hpctoolkit_prefill_group"


def prefill_groups(positions: Sequence[int], batch: int) -> list[list[int]]:
    """Indices into `positions`, cut into runs that share `position // batch`, in order.

    `positions` are engine-local sample positions, strictly increasing (a resumed run leaves gaps).
    """
    if batch < 1:
        raise ValueError(f"prefill batch must be >= 1, got {batch}")
    groups: list[list[int]] = []
    last = None
    for i, p in enumerate(positions):
        if p < 0 or (last is not None and p <= last):
            raise DataIntegrityError(
                f"sample positions must be increasing and >= 0: position {p} follows {last}"
            )
        if groups and p // batch == last // batch:  # type: ignore[operator]
            groups[-1].append(i)
        else:
            groups.append([i])
        last = p
    return groups


def engine_positions(engine: int, num_engines: int, indices: Sequence[int]) -> list[int]:
    """Engine-local positions of prompt indices `engine::num_engines`: prompt `engine + k *
    num_engines` is the engine's `k`th, whichever of them an attempt has left to capture."""
    wrong = [i for i in indices if i < engine or (i - engine) % num_engines]
    if wrong:
        raise DataIntegrityError(
            f"engine {engine} of {num_engines} was handed prompt {wrong[0]}, not one of its own"
        )
    return [(i - engine) // num_engines for i in indices]


def call_bounds(positions: Sequence[int], per_call: int) -> list[tuple[int, int]]:
    """`[start, stop)` index ranges into `positions` that share `position // per_call`: the
    capture calls of a role, cut at fixed positions (`per_call` a multiple of the prefill batch,
    so a call holds whole batches)."""
    return [(g[0], g[-1] + 1) for g in prefill_groups(positions, per_call)]


def group_of(params: Mapping[str, Any] | None) -> tuple[str, int] | None:
    """(group id, size) of a request's `kv_transfer_params`, or None for a request of no batch."""
    raw = (params or {}).get(GROUP_PARAM)
    if raw is None:
        return None
    gid, size = raw
    return str(gid), int(size)


class PrefillGate:
    """Holds each request of a prefill batch back until the scheduler saw the whole batch.

    Called from vLLM's scheduler thread only: `admit` per waiting request, `end_pass` once per
    schedule pass (the connector's `build_connector_meta`), `finished` when vLLM finishes one.
    A released group stays released until all its requests finished, so a request preempted and
    recomputed is admitted at once.
    """

    def __init__(self) -> None:
        self._seen: dict[str, set[str]] = {}
        self._size: dict[str, int] = {}
        self._released: set[str] = set()

    def admit(self, req_id: str, params: Mapping[str, Any] | None) -> bool:
        group = group_of(params)
        if group is None:
            return True
        gid, size = group
        if self._size.setdefault(gid, size) != size:
            raise DataIntegrityError(
                f"prefill group {gid}: request {req_id} says size {size}, not {self._size[gid]}"
            )
        self._seen.setdefault(gid, set()).add(req_id)
        return gid in self._released

    def end_pass(self) -> None:
        for gid, seen in self._seen.items():
            if len(seen) >= self._size[gid]:
                self._released.add(gid)

    def finished(self, req_id: str, params: Mapping[str, Any] | None) -> None:
        group = group_of(params)
        if group is None or group[0] not in self._seen:
            return
        gid = group[0]
        self._seen[gid].discard(req_id)
        if not self._seen[gid] and gid in self._released:
            del self._seen[gid], self._size[gid]
            self._released.discard(gid)

    @property
    def held(self) -> int:
        """Groups seen and not yet released (for tests and debugging)."""
        return len(set(self._seen) - self._released)
