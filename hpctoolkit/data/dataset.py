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

Read ahead
    With `read_ahead=D` and `workers=W` (both > 0) the next `D` samples are fetched and checked
    on `W` threads while the consumer trains on the current one (`data.prefetch.read_ahead`):
    the order stays the manifests' order, `state_dict()` counts the samples handed out (not
    those fetched ahead), and at most `D` fetched samples wait beside the one the consumer holds.
    A CUDA reader's copy and check run on a side stream per thread, marked in use on the stream
    that was current where the iteration started (the trainer's compute stream).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import IterableDataset, get_worker_info

from hpctoolkit.capture.manifest import Manifest
from hpctoolkit.data import prefetch
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
        read_ahead: int = 0,
        workers: int = 0,
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
        if read_ahead < 0 or workers < 0:
            raise ConfigError(f"read_ahead={read_ahead} and workers={workers} must be >= 0")
        self.read_ahead, self.workers = read_ahead, workers
        # Buffers recycled by `release()`: enough for every sample in flight.
        self.pool = BufferPool(
            max(pool_buffers, read_ahead + 1), pin=device is not None and device.type == "cuda"
        )
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
        start = self._consumed
        consumer = (
            torch.cuda.current_stream(self.device)
            if self.device is not None and self.device.type == "cuda"
            else None
        )

        def mine() -> Iterator[tuple[int, Manifest]]:
            local = -1
            for i, raw in enumerate(_iter_source(self.manifests)):
                if i % self.world_size != self.rank:
                    continue
                local += 1
                if local >= start:
                    yield local, as_manifest(raw)

        cancel = threading.Event()

        def fetch(item: tuple[int, Manifest]) -> tuple[int, Sample]:
            local, manifest = item
            expected = self.expected_input_ids(manifest) if self.expected_input_ids else None
            if consumer is None:
                return local, self._fetch(manifest, expected, cancel)
            with torch.cuda.stream(consumer):  # a worker thread's current stream: the consumer's
                return local, self._fetch(manifest, expected, cancel)

        for local, sample in prefetch.read_ahead(
            mine(),
            fetch,
            workers=self.workers,
            depth=self.read_ahead,
            name=f"fetch-rank{self.rank}",
            cancel=cancel,
        ):
            self._consumed = local + 1
            yield sample

    def _fetch(self, manifest: Manifest, expected: torch.Tensor | None, cancel: threading.Event) -> Sample:
        return fetch_sample(
            self.store,
            manifest,
            retry_max_wait_s=self.retry_max_wait_s,
            remove=self.remove,
            expected_input_ids=expected,
            pool=self.pool,
            device=self.device,
            cancel=cancel,
        )
