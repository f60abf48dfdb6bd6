"""A stage's publish path, apart from vLLM: read its rows out of the cache, put them, remove them.

Imports torch and the store's fragment layer only (no vLLM, no Mooncake), so the path the
connector runs is tested on a machine with torch alone, a GPU one included
(`tests/gpu/test_publish_gpu.py`).

Threading and streams. `StageRows.publish` reads the cache-only layer and puts the rows; with
pipeline parallelism the connector runs it on the stage's `Publisher` thread, so the step
returns at once. vLLM runs each CUDA worker on a stream of its own, created non-blocking
(`vllm/utils/torch_utils.py`), and the cache writes of a sample's last chunk are queued on that
stream during the previous step; a thread reading the cache on its own (default) stream is
ordered after none of them and can copy rows before they are written, silently. So the step
thread records an event on its current stream when it hands a sample to the thread
(`StageRows.ready`, called in `bind_connector_metadata`, i.e. after every write of the steps
before it was queued), and the job waits for that event before it gathers. On the CPU the
writes are synchronous and there is no event.

Lifetime. The rows are copied to the host (page-locked, `fragments.host_copies`) before `publish`
returns; the connector reports a
sample sent only after that, and vLLM frees its blocks only once every stage reported.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hpctoolkit.capture import Manifest
from hpctoolkit.dtypes import dtype_name
from hpctoolkit.engine.rows import gather_heads, slot_mapping
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.integrity import devsum
from hpctoolkit.store.fragments import host_copies, publish_stage

# A job's tag: ("publish" | "remove", request id).
Tag = tuple[str, str]


class Publisher:
    """One daemon thread that runs a worker's publishes, in submission order.

    Threading: `submit`, `completed` and `close` are called from the worker's step thread only;
    the jobs run on the publisher thread, which is the only user of the store client while it
    runs (the connector creates the client inside the first job). After a job raises, the thread
    runs no further job: the failure is reported once, by `completed`, and the samples queued
    behind it are never reported published. A daemon thread, so a put stuck on a dead master
    cannot hold up the worker's exit; `close` waits for the queued jobs, bounded.
    """

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue[tuple[Tag, Callable[[], None]] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[Tag, BaseException | None]] = queue.SimpleQueue()
        self.in_flight = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, tag: Tag, job: Callable[[], None]) -> None:
        self.in_flight += 1
        self._jobs.put((tag, job))

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            tag, job = item
            try:
                job()
            except BaseException as err:  # noqa: BLE001  (handed to the step thread, which raises it)
                self._done.put((tag, err))
                return
            self._done.put((tag, None))

    def completed(self) -> list[tuple[Tag, BaseException | None]]:
        """(tag, error or None) of every job that ended since the last call, in order."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                self.in_flight -= len(out)
                return out

    def close(self, timeout_s: float) -> bool:
        """Let the queued jobs finish, then stop; False if the thread is still busy after `timeout_s`."""
        self._jobs.put(None)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


@dataclass(frozen=True)
class StageRows:
    """One worker's cache-only layer and its place in the pipeline: what its publishes read.

    `kv_cache` is the `[num_blocks, num_heads, block_size, hidden]` view vLLM hands connectors;
    `heads` maps each capture id the stage owns to its head (`rows.head_index_of`).
    """

    kv_cache: torch.Tensor
    block_size: int
    heads: Mapping[int, int]
    stage: int

    def ready(self) -> torch.cuda.Event | None:
        """An event after every write queued so far on this thread's current stream (None on CPU)."""
        if self.kv_cache.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.kv_cache.device))
        return event

    def gather(
        self,
        block_ids: Sequence[int],
        num_tokens: int,
        ready: torch.cuda.Event | None = None,
        device_sums: bool = False,
    ) -> tuple[dict[int, torch.Tensor], dict[int, bytes] | None]:
        """`{capture id: [num_tokens, hidden]}` host copies of the rows, read after `ready`, and
        with `device_sums` on a GPU their `devsum` checksums by capture id, computed on the GPU
        before the copy to the host (None on the CPU, where `publish_stage` sums the rows)."""
        kv = self.kv_cache
        slots = slot_mapping(block_ids, self.block_size, num_tokens)
        if ready is None:
            return gather_heads(kv, slots, self.heads), None
        # The rows are read on this thread's stream, which nothing orders after the writer's.
        ready.synchronize()
        with torch.cuda.device(kv.device):
            rows = gather_heads(kv, slots.to(kv.device), self.heads)
            sums = dict(zip(rows, devsum.digests8(list(rows.values())), strict=True)) if device_sums else None
            return dict(zip(rows, host_copies(list(rows.values())), strict=True)), sums

    def publish(
        self,
        store: Any,
        manifest: Manifest,
        block_ids: Sequence[int],
        token_ids: Sequence[int],
        ready: torch.cuda.Event | None = None,
    ) -> int:
        """Put this stage's objects of one sample (stage 0 adds `input_ids`); bytes published."""
        if dtype_name(self.kv_cache.dtype) != manifest.last.dtype:
            raise DataIntegrityError(
                f"sample {manifest.sample_key}: cache dtype {self.kv_cache.dtype} differs from the "
                f"manifest's {manifest.last.dtype}"
            )
        device_sums = bool(manifest.sums) and manifest.sums_algorithm == devsum.ALGORITHM
        layers, sums = self.gather(block_ids, manifest.num_tokens, ready, device_sums)
        input_ids = torch.tensor(list(token_ids), dtype=torch.long) if self.stage == 0 else None
        return publish_stage(store, manifest, self.stage, layers, input_ids, sums)

    def remove(self, store: Any, manifest: Manifest) -> None:
        """Remove this stage's objects of one sample (one that will never be referenced)."""
        store.remove([f.key for f in manifest.fragments_of_stage(self.stage)])

    def publish_async(
        self,
        publisher: Publisher,
        get_store: Callable[[], Any],
        req_id: str,
        manifest: Manifest,
        block_ids: Sequence[int],
        token_ids: Sequence[int],
    ) -> None:
        """Hand one publish to `publisher`, ordered after the writes queued so far (module doc)."""
        ready = self.ready()

        def job() -> None:
            self.publish(get_store(), manifest, block_ids, token_ids, ready)

        publisher.submit(("publish", req_id), job)

    def remove_async(
        self, publisher: Publisher, get_store: Callable[[], Any], req_id: str, manifest: Manifest
    ) -> None:
        """Hand a removal to `publisher`: it runs after every publish submitted before it."""
        publisher.submit(("remove", req_id), lambda: self.remove(get_store(), manifest))
