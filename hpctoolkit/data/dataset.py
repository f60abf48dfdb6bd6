"""`HiddenStateDataset`: manifests in, whole checked samples out, online or from offline shards.

Order and sharding
    Manifests are taken in the order the source gives them. Data-parallel rank `r` of `world_size`
    takes the manifests at positions `i` with `i % world_size == r`, so the split is deterministic
    and disjoint. `skip` (or `load_state_dict`) resumes a rank after its first `skip` samples: a
    trainer that saves `state_dict()` with its checkpoint sees the same data order after a restart.

Sources
    A sequence or any iterable of `Manifest`, manifest dicts or manifest JSON strings; or a
    `queue.Queue`-like object (it has `get()`), read until it yields `None`. A malformed or
    inconsistent manifest raises `DataIntegrityError` naming the sample key and the field.

Each sample is fetched whole by `fetch_sample` (see `hpctoolkit.store.fragments`); a partial
sample is never yielded. A consumer that calls `sample.release()` once it is done with a sample
(e.g. after copying it to the GPU) lets the next sample reuse its buffer instead of faulting in a
fresh one; a consumer that does not release loses nothing but that speed. `device` (a CUDA
trainer's): samples with GPU sums are checked on that device and carry the checked copy
(`Sample.device_copy`), in page-locked buffers. Use with `DataLoader(num_workers=0)`: the store client is one per process
and the fetch is a zero-copy transfer, so worker processes would add a copy, not speed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from hpctoolkit.capture.manifest import Manifest
from hpctoolkit.data.sample import BufferPool, Sample
from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.store.api import ObjectStore
from hpctoolkit.store.fragments import fetch_sample

ManifestLike = Manifest | Mapping[str, Any] | str


def as_manifest(raw: ManifestLike) -> Manifest:
    """Parse and validate one manifest; raise `DataIntegrityError` naming the key and field."""
    if isinstance(raw, Manifest):
        raw.validate()
        return raw
    if isinstance(raw, str):
        return Manifest.from_json(raw)
    if isinstance(raw, Mapping):
        return Manifest.from_dict(raw)
    raise DataIntegrityError(f"manifest must be a Manifest, a mapping or JSON text, got {type(raw).__name__}")


def _iter_source(source: Any) -> Iterator[Any]:
    if hasattr(source, "get") and not hasattr(source, "__iter__"):
        while True:
            item = source.get()
            if item is None:
                return
            yield item
    else:
        yield from source


class HiddenStateDataset(IterableDataset[Sample]):
    """Iterates `Sample`s for this rank; see the module docstring for order, sharding and resume."""

    def __init__(
        self,
        manifests: Iterable[ManifestLike] | Any,
        store: ObjectStore,
        *,
        retry_max_wait_s: float,
        rank: int = 0,
        world_size: int = 1,
        skip: int = 0,
        remove: bool = True,
        expected_input_ids: Callable[[Manifest], torch.Tensor | None] | None = None,
        pool_buffers: int = 2,
        device: torch.device | None = None,
    ):
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank={rank} must lie in [0, world_size={world_size})")
        if skip < 0:
            raise ConfigError(f"skip must be >= 0, got {skip}")
        self.manifests = manifests
        self.store = store
        self.retry_max_wait_s = retry_max_wait_s
        self.rank = rank
        self.world_size = world_size
        self.remove = remove
        self.expected_input_ids = expected_input_ids
        # A CUDA reader copies each sample to its device (`fetch_sample`): page-locked buffers.
        self.device = device
        self.pool = BufferPool(pool_buffers, pin=device is not None and device.type == "cuda")
        self._consumed = skip

    def state_dict(self) -> dict[str, int]:
        """What to save with a checkpoint: samples this rank has yielded, and the sharding."""
        return {"consumed": self._consumed, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if (state.get("rank"), state.get("world_size")) != (self.rank, self.world_size):
            raise ConfigError(
                f"dataset state is for rank {state.get('rank')} of {state.get('world_size')}, "
                f"this dataset is rank {self.rank} of {self.world_size}; resume with the same sharding"
            )
        self._consumed = int(state["consumed"])

    def __iter__(self) -> Iterator[Sample]:
        info = get_worker_info()
        if info is not None and info.num_workers > 1:
            raise ConfigError(
                "HiddenStateDataset must run with DataLoader(num_workers=0 or 1): sharding is by "
                "data-parallel rank, and a second worker would fetch (and remove) the same samples"
            )
        local = -1
        start = self._consumed
        for i, raw in enumerate(_iter_source(self.manifests)):
            if i % self.world_size != self.rank:
                continue
            local += 1
            if local < start:
                continue
            manifest = as_manifest(raw)
            expected = self.expected_input_ids(manifest) if self.expected_input_ids else None
            sample = fetch_sample(
                self.store,
                manifest,
                retry_max_wait_s=self.retry_max_wait_s,
                remove=self.remove,
                expected_input_ids=expected,
                pool=self.pool,
                device=self.device,
            )
            self._consumed = local + 1
            yield sample
