"""Pure helpers of the connector: sample keys, slot arithmetic and the head-to-capture-id map.

Kept apart from `connector.py` so they are unit-tested without vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hpctoolkit.capture import owned_layers, sanitize_key
from hpctoolkit.errors import ConfigError, DataIntegrityError


def sample_key_for(run_prefix: str, request_id: str) -> str:
    """Store-safe sample key: the run-unique prefix, then the sanitised vLLM request id.

    vLLM's request ids restart with every engine, so the prefix is what keeps keys from different
    runs and engines apart in one store.
    """
    if not run_prefix or sanitize_key(run_prefix) != run_prefix:
        raise ConfigError(f"run prefix {run_prefix!r} must be non-empty and use only [A-Za-z0-9._-]")
    return sanitize_key(f"{run_prefix}-{sanitize_key(request_id)}")


def slot_mapping(block_ids: Sequence[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Cache slots of a request's first `num_tokens` tokens, from its block table."""
    if num_tokens > len(block_ids) * block_size:
        raise DataIntegrityError(
            f"request holds {len(block_ids)} blocks of {block_size} slots, fewer than its {num_tokens} tokens"
        )
    blocks_b1 = torch.as_tensor(list(block_ids), dtype=torch.long).reshape(-1, 1)
    offsets_1s = torch.arange(block_size, dtype=torch.long).reshape(1, -1)
    return (blocks_b1 * block_size + offsets_1s).flatten()[:num_tokens]


def stage_heads(capture_ids: Sequence[int], num_layers: int, pp_size: int) -> int:
    """Heads of the cache-only layer on every stage under the PP patch: the largest owned count.

    The patch gives every stage one layer name and one head count, so the hidden states form one
    KV cache group with one block table on all stages (also for hybrid targets, where each
    distinct hidden-state spec would get a group of its own); a stage fills its first heads.
    """
    return max(len(owned_layers(capture_ids, num_layers, r, pp_size)) for r in range(pp_size))


def head_index_of(
    capture_ids: Sequence[int], owned: Sequence[int], num_heads: int, padded_heads: int | None = None
) -> dict[int, int]:
    """Which head of this stage's cache-only layer holds each owned capture id.

    Stock vLLM sizes the cache-only layer with the **global** capture-id list (heads follow
    `capture_ids`). The PP patch sizes it alike on every stage (`padded_heads`, from
    `stage_heads`) and puts the stage's **local** ids first (heads follow `owned`); a layer of
    exactly the local count is accepted too. Any other head count means the engine and the
    manifest disagree.
    """
    ids = list(capture_ids)
    if padded_heads is not None and num_heads == padded_heads and len(owned) <= num_heads:
        return {k: j for j, k in enumerate(owned)}
    if num_heads == len(ids):
        return {k: ids.index(k) for k in owned}
    if num_heads == len(owned):
        return {k: j for j, k in enumerate(owned)}
    raise DataIntegrityError(
        f"cache-only layer has {num_heads} heads, but the engine captures {len(ids)} ids {ids} "
        f"of which this stage owns {len(owned)} {list(owned)}"
        + (f" (every stage's layer should have {padded_heads})" if padded_heads is not None else "")
    )


def gather_heads(
    kv_cache: torch.Tensor, slots: torch.Tensor, heads: Mapping[int, int]
) -> dict[int, torch.Tensor]:
    """`{capture id: [num_tokens, hidden]}` rows of the cache-only layer at `slots`, copied out.

    `heads` maps each capture id to its head of the layer (`head_index_of`). vLLM hands
    connectors the layer as a `[num_blocks, num_heads, block_size, hidden]` view whatever the
    backend's physical layout (vLLM's own `extract_from_kv_cache` indexes it the same way; the
    connector checks the shape when it binds the layer). One gather per head yields each id's
    rows as a contiguous tensor of their own, ready to put. The copy matters: the blocks are
    freed and reused as soon as the request is reported sent.
    """
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    return {k: kv_cache[blocks, h, offsets] for k, h in heads.items()}
