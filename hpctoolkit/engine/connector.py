"""`HpcHiddenStatesConnector`: vLLM KV connector that publishes captured hidden states as fragments.

Loaded out of tree through `kv_transfer_config.kv_connector_module_path` (no vLLM patch), next to
the `extract_hidden_states` speculative method. That method's `ExtractHiddenStatesModel` writes,
for every prompt token, one row per capture id into a cache-only KV layer
(`CacheOnlyAttentionLayer`, one "head" per capture id, head size = hidden size). This connector
reads those rows back out of the paged cache once a request's prefill is complete and publishes
them to the object store in the universal fragment layout of `hpctoolkit.capture.manifest`.

Lifecycle of one request (vLLM calls; `S` = scheduler-role instance, `W` = worker-role instance):

1. Step N (the step that computes the request's last prompt token): `S.build_connector_meta`
   tracks every request's prompt, block ids and computed tokens from the scheduler output, and
   notes that this one completes in step N: it builds the manifest
   (`hpctoolkit.capture.build_manifest`). The target forward runs; the drafter writes the
   chunk's rows into the cache-only layer; the single sampled token (`max_tokens=1`) finishes
   the request.
2. Step N+1, the next step scheduled: `S.build_connector_meta` hands the sample (block ids of the
   hidden-state KV group, prompt ids, manifest) to every worker. Each worker runs its steps in
   order, so by then it has cached its rows of step N. `W.bind_connector_metadata` (before the
   step's forward): TP rank 0 of stage `pp_rank` gathers the rows of the capture ids it owns
   (`owned_layers`) and publishes them with `publish_stage` (stage 0 also publishes
   `input_ids`). One stage (PP=1) does it synchronously, there and then. With pipeline
   parallelism step N+1 is scheduled while step N is still on the later stages, so each stage
   publishes where it would otherwise wait: a non-last stage while the later stages finish the
   request's last chunk, the last stage until the next request's activations arrive. There the
   put runs on the stage's publisher thread (`_Publisher`), so the step returns at once and the
   engine core, which waits for every stage's step, is not held up by a put.
3. `S.request_finished_all_groups` (when step N's output is processed; at PP=1 before step N+1
   is scheduled): returns `(True, {"hpctoolkit_manifest": ...})`: blocks stay allocated, and
   the manifest travels to the client in `kv_transfer_params`. It checks that the block ids the
   sample was handed out with are the request's. A request finished before its prefill
   completed (abort, preemption) is never published; one aborted after its sample was handed
   out keeps its blocks until the stages reported and returns no manifest (its fragments stay
   in the store unreferenced, with a warning).
4. `W.get_finished` collects the publishes its thread completed (PP > 1) and reports a
   published request in `finished_sending` once vLLM lists it among the finished ones. vLLM's
   `KVOutputAggregator` reports it finished only once `get_finished_count()` workers did, i.e.
   once every PP stage published; then the scheduler frees the blocks. `num_published` counts
   this worker's completed publishes; the engine reads it through the worker extension
   (`worker_ext.py`) to know when a multiprocess engine has published a sample.

Where things are decided: the stage is `get_pp_group().rank_in_group` and the TP rank
`get_tensor_model_parallel_rank()` (read in `register_kv_caches`, after distributed init);
`pp_size` is `parallel_config.pipeline_parallel_size`; the ids a stage owns are
`owned_layers(capture_ids, L, pp_rank, pp_size)` (honouring `VLLM_PP_LAYER_PARTITION`). The
cache-only layer may carry the global id list (stock vLLM) or only the stage's ids (a PP patch
sizing it per stage); `rows.head_index_of` accepts both.

Fail-closed rules:

* The worker checks in its constructor that the store master is reachable
  (`check_reachable(address, connect_timeout_s)`): an unreachable master fails engine start with a
  `StoreError` naming the address, within `connect_timeout_s`.
* The store client itself is created lazily, at the first publish: creating a Mooncake client
  registers buffers, which perturbs vLLM's KV-cache memory profiling during engine start.
* A failing publish raises `StoreError` out of the step that runs it, or (publisher thread)
  out of the next step that collects it (never a warning, never a dropped sample), and the
  request is not reported sent; a publisher thread runs nothing after a failure. Before raising,
  the worker (or, for a scheduler-side check, the engine core) writes a one-line fault
  record into `fault_dir` (when configured; it must be visible to the engine's caller, i.e. on a
  shared filesystem for multi-node engines), so a caller whose worker runs in another process
  reports the store error itself rather than vLLM's generic engine-death error.
* Rows are copied out of the cache before the blocks are released; the layer's head count must
  match the manifest (`rows.head_index_of`), the dtype must match, or `DataIntegrityError`.

Settings arrive through `kv_connector_extra_config` (JSON-able; see `ExtraConfig`).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)
from vllm.logger import init_logger

from hpctoolkit.capture import Manifest, build_manifest, check_layer_layout, owned_layers
from hpctoolkit.engine.rows import gather_heads, head_index_of, sample_key_for, slot_mapping
from hpctoolkit.errors import ConfigError, DataIntegrityError, StoreError
from hpctoolkit.store.fragments import INPUT_IDS_SHA256, input_ids_digest, publish_stage

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

# Key of the manifest in a request's `kv_transfer_params`.
MANIFEST_PARAM = "hpctoolkit_manifest"
# Key of our settings inside `kv_connector_extra_config`.
EXTRA_CONFIG_KEY = "hpctoolkit"
# vLLM captures the final id (L) before the target's final norm (measured against HF).
LAST_HIDDEN_STATES_PRENORM = True
DEFAULT_STORE_FACTORY = "hpctoolkit.store.mooncake:MooncakeStore"
DEFAULT_REACHABILITY_CHECK = "hpctoolkit.store.mooncake:check_reachable"
# How long a worker's shutdown waits for the publishes still queued on its publisher thread.
PUBLISHER_CLOSE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ExtraConfig:
    """Our part of `kv_connector_extra_config` (under key `EXTRA_CONFIG_KEY`).

    `run_prefix` is unique per engine (run id + engine index), so sample keys never collide across
    runs or engines sharing a store. `store_address` None means the factory needs no master (unit
    tests with an in-process fake); then no reachability check runs.
    """

    run_prefix: str
    store_address: str | None
    store_config: dict[str, Any] = field(default_factory=dict)
    store_factory: str = DEFAULT_STORE_FACTORY
    reachability_check: str = DEFAULT_REACHABILITY_CHECK
    connect_timeout_s: float = 10.0
    fault_dir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_prefix": self.run_prefix,
            "store_address": self.store_address,
            "store_config": dict(self.store_config),
            "store_factory": self.store_factory,
            "reachability_check": self.reachability_check,
            "connect_timeout_s": self.connect_timeout_s,
            "fault_dir": self.fault_dir,
        }

    @classmethod
    def from_dict(cls, d: Any) -> ExtraConfig:
        if not isinstance(d, dict) or "run_prefix" not in d:
            raise ConfigError(
                f"kv_connector_extra_config[{EXTRA_CONFIG_KEY!r}] must be a mapping with run_prefix, got {d!r}"
            )
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config[{EXTRA_CONFIG_KEY!r}] has unknown keys {sorted(unknown)}"
            )
        return cls(**d)


def _load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"{spec!r} must be 'module:attribute'")
    return getattr(importlib.import_module(module), attr)


def write_fault(fault_dir: str | None, where: str, err: BaseException) -> None:
    """Record a fatal data-path error where the engine's caller can find it (best effort)."""
    if not fault_dir:
        return
    try:
        os.makedirs(fault_dir, exist_ok=True)
        record = {"where": where, "type": type(err).__name__, "message": str(err), "time": time.time()}
        path = os.path.join(fault_dir, f"fault-{os.getpid()}-{time.monotonic_ns()}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(record, f)
        os.replace(path + ".tmp", path)
    except OSError:
        # The original error is raised right after; a failed side-channel write must not mask it.
        logger.exception("hpctoolkit: could not write the fault record into %s", fault_dir)


def read_faults(fault_dir: str | None) -> list[dict[str, Any]]:
    """Fault records written by `write_fault`, oldest first."""
    if not fault_dir or not os.path.isdir(fault_dir):
        return []
    out = []
    for name in sorted(os.listdir(fault_dir)):
        if name.startswith("fault-") and name.endswith(".json"):
            try:
                with open(os.path.join(fault_dir, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue
    return sorted(out, key=lambda r: r.get("time", 0))


class _Publisher:
    """One daemon thread that runs a worker's publishes, in submission order.

    Threading: `submit`, `completed` and `close` are called from the worker's step thread only;
    the jobs run on the publisher thread, which is the only user of the store client while it
    runs (the connector creates the client inside the first job). After a job raises, the thread
    runs no further job: the failure is reported once, by `completed`, and the samples queued
    behind it are never reported published. A daemon thread, so a put stuck on a dead master
    cannot hold up the worker's exit; `close` waits for the queued jobs, bounded.
    """

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue[tuple[str, Callable[[], None]] | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[str, BaseException | None]] = queue.SimpleQueue()
        self.in_flight = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, req_id: str, job: Callable[[], None]) -> None:
        self.in_flight += 1
        self._jobs.put((req_id, job))

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            req_id, job = item
            try:
                job()
            except BaseException as err:  # noqa: BLE001  (handed to the step thread, which raises it)
                self._done.put((req_id, err))
                return
            self._done.put((req_id, None))

    def completed(self) -> list[tuple[str, BaseException | None]]:
        """(request id, error or None) of every job that ended since the last call."""
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


@dataclass
class PendingSample:
    """Scheduler → worker: one finished request to publish. Plain data (it is pickled to workers)."""

    req_id: str
    block_ids: list[int]
    token_ids: list[int]
    manifest: dict[str, Any]


@dataclass
class HpcConnectorMetadata(KVConnectorMetadata):
    pending: list[PendingSample] = field(default_factory=list)


@dataclass
class _Prompt:
    """Scheduler side: a request whose prompt is being computed, as the scheduler outputs show it."""

    token_ids: list[int]
    block_ids: list[int]  # of the hidden-state KV group, in order


class HpcHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Publishes each finished request's captured hidden states as per-stage fragments.

    See the module docstring for the lifecycle and the fail-closed rules.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        raw = self._kv_transfer_config.get_from_extra_config(EXTRA_CONFIG_KEY, None)
        self._extra = ExtraConfig.from_dict(raw)
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "extract_hidden_states":
            raise ConfigError(
                "HpcHiddenStatesConnector needs speculative_config.method='extract_hidden_states'"
            )
        draft_hf = spec.draft_model_config.hf_config
        self._capture_ids = [int(i) for i in getattr(draft_hf, "eagle_aux_hidden_state_layer_ids", [])]
        model_config = vllm_config.model_config
        self._num_layers = int(model_config.hf_text_config.num_hidden_layers)
        # The layout the engine was asked for must be the one the manifest describes.
        check_layer_layout(self._capture_ids, self._num_layers)
        self._hidden_size = int(model_config.get_hidden_size())
        self._dtype = str(model_config.dtype).removeprefix("torch.")
        parallel = vllm_config.parallel_config
        self._pp_size = int(parallel.pipeline_parallel_size)
        # ExampleHiddenStatesConnector's helpers find the hidden-state KV group by its spec type
        # (group 0 for a dense target; its own group for hybrid targets) and its block size.
        self._cache_gid = ExampleHiddenStatesConnector._find_cache_kv_group_id(kv_cache_config)
        self._block_size = ExampleHiddenStatesConnector._get_cache_block_size(
            vllm_config, kv_cache_config, self._cache_gid
        )

        # Scheduler side: prompts being computed; samples whose last prompt token was scheduled in
        # the step built last (handed out with the next); samples handed out, request unfinished.
        self._prompts: dict[str, _Prompt] = {}
        self._completing: dict[str, PendingSample] = {}
        self._handed: dict[str, PendingSample] = {}

        # Worker side (rank facts are known only after distributed init: register_kv_caches).
        self._kv_cache: torch.Tensor | None = None
        self._pp_rank = 0
        self._tp_rank = 0
        self._owned: list[int] = []
        self._heads: dict[int, int] = {}
        self._store: Any = None
        self._publisher: _Publisher | None = None
        self._published: set[str] = set()
        self._finished_seen: set[str] = set()
        self.num_published = 0
        if role == KVConnectorRole.WORKER and self._extra.store_address is not None:
            check = _load(self._extra.reachability_check)
            try:
                # Raises StoreError naming the address; engine start fails with it.
                check(self._extra.store_address, self._extra.connect_timeout_s)
            except BaseException as err:
                write_fault(self._extra.fault_dir, "worker start: store reachability", err)
                raise

    # ------------------------------------------------------------------ PP/TP and completion

    def get_finished_count(self) -> int:
        """One `finished_sending` report per pipeline stage (its TP rank 0) completes a request.

        This is the completion barrier: at PP>1 the blocks are freed, and the sample counts as
        published, only once every stage published its fragments.
        """
        return self._pp_size

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        tp_rank = get_tensor_model_parallel_rank()
        pp_rank = get_pp_group().rank_in_group
        layers = get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches))
        if len(layers) != 1:
            raise DataIntegrityError(
                f"stage {pp_rank} holds {len(layers)} cache-only layers ({sorted(layers)}); expected 1"
            )
        (name,) = layers
        self._bind_cache(kv_caches[name], pp_rank, tp_rank, name)

    def _bind_cache(self, kv: torch.Tensor, pp_rank: int, tp_rank: int, name: str = "cache_only") -> None:
        """Attach this worker's cache-only layer and its place in the PP x TP grid."""
        self._pp_rank, self._tp_rank = pp_rank, tp_rank
        self._owned = owned_layers(self._capture_ids, self._num_layers, pp_rank, self._pp_size)
        if kv.dim() != 4 or kv.shape[2] != self._block_size or kv.shape[3] != self._hidden_size:
            raise DataIntegrityError(
                f"cache-only layer {name} has shape {tuple(kv.shape)}; expected "
                f"[blocks, heads, {self._block_size}, {self._hidden_size}]"
            )
        self._kv_cache = kv
        self._heads = head_index_of(self._capture_ids, self._owned, kv.shape[1])
        logger.info(
            "hpctoolkit connector: stage %d/%d tp %d owns capture ids %s (cache layer %s, shape %s)",
            pp_rank,
            self._pp_size,
            tp_rank,
            self._owned,
            name,
            tuple(kv.shape),
        )

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return  # store-only connector

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        # The rows are already in the cache-only layer; they are read once the prefill is complete.
        return

    def wait_for_save(self) -> None:
        return  # publishing starts in bind_connector_metadata; get_finished reports it

    def _get_store(self) -> Any:
        if self._store is None:
            factory = _load(self._extra.store_factory)
            try:
                from hpctoolkit.store.config import StoreConfig

                cfg = StoreConfig(**self._extra.store_config)
                self._store = factory(self._extra.store_address, cfg, "writer")
            except StoreError:
                raise
            except Exception as err:
                raise StoreError(
                    f"could not create the store client for master {self._extra.store_address}: {err}"
                ) from err
        return self._store

    def _publish(self, pending: PendingSample) -> None:
        manifest = Manifest.from_dict(pending.manifest)
        if self._kv_cache is None:
            raise DataIntegrityError(f"sample {manifest.sample_key}: connector has no registered KV cache")
        if str(self._kv_cache.dtype).removeprefix("torch.") != manifest.last.dtype:
            raise DataIntegrityError(
                f"sample {manifest.sample_key}: cache dtype {self._kv_cache.dtype} differs from the "
                f"manifest's {manifest.last.dtype}"
            )
        slots = slot_mapping(pending.block_ids, self._block_size, manifest.num_tokens)
        layers = gather_heads(self._kv_cache, slots, {k: self._heads[k] for k in self._owned})
        input_ids = torch.tensor(pending.token_ids, dtype=torch.long) if self._pp_rank == 0 else None
        publish_stage(self._get_store(), manifest, self._pp_rank, layers, input_ids)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before this step's forward (module docstring, step 2).
        if not isinstance(connector_metadata, HpcConnectorMetadata) or self._tp_rank != 0:
            return
        for pending in connector_metadata.pending:
            if self._pp_size > 1:
                if self._publisher is None:
                    self._publisher = _Publisher(f"hpctoolkit-publish-pp{self._pp_rank}")
                self._publisher.submit(pending.req_id, functools.partial(self._publish, pending))
                continue
            try:
                self._publish(pending)
            except BaseException as err:
                self._record_fault(pending.req_id, err)
                raise
            self._count_published(pending.req_id)

    def _record_fault(self, req_id: str, err: BaseException) -> None:
        write_fault(self._extra.fault_dir, f"stage {self._pp_rank} publish of {req_id}", err)

    def _count_published(self, req_id: str) -> None:
        self._published.add(req_id)
        self.num_published += 1

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for req_id, err in self._publisher.completed() if self._publisher is not None else ():
            if err is not None:
                self._record_fault(req_id, err)
                raise err
            self._count_published(req_id)
        # vLLM requires a reported id to have been among finished_req_ids, in this or an
        # earlier call; both normally arrive in the same step.
        self._finished_seen |= finished_req_ids
        done = self._published & self._finished_seen
        self._published -= done
        self._finished_seen -= done
        # Ids this rank will never publish (other TP ranks, unpublished aborts) are not kept.
        if self._tp_rank != 0:
            self._finished_seen.clear()
        return (done or None), None

    def shutdown(self) -> None:
        publisher, self._publisher = self._publisher, None
        if publisher is not None and not publisher.close(PUBLISHER_CLOSE_TIMEOUT_S):
            logger.warning(
                "hpctoolkit connector: stage %d's publisher was still busy %g s after shutdown began",
                self._pp_rank,
                PUBLISHER_CLOSE_TIMEOUT_S,
            )
        store, self._store = self._store, None
        if store is not None:
            store.close()

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False  # nothing is ever loaded

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            raise AssertionError("HpcHiddenStatesConnector never loads KV")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        # Samples whose last prompt token was scheduled in the step built before this one.
        meta = HpcConnectorMetadata(pending=list(self._completing.values()))
        self._handed.update(self._completing)
        self._completing = {}
        self._track(scheduler_output)
        return meta

    def _track(self, scheduler_output: SchedulerOutput) -> None:
        """Follow each request's prompt and blocks through the scheduler output of one step.

        The same bookkeeping as the model runner's: a new request brings its prompt and block
        table, a running one appends its new blocks, a resumed (preempted) one replaces them.
        A request whose computed tokens reach its prompt length in this step completes.
        """
        gid = self._cache_gid
        scheduled = scheduler_output.num_scheduled_tokens
        progress: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.prompt_token_ids is None or new.req_id in self._completing or new.req_id in self._handed:
                continue  # embeds only (request_finished refuses it), or its sample is out already
            self._prompts[new.req_id] = _Prompt(list(new.prompt_token_ids), list(new.block_ids[gid]))
            progress.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            prompt = self._prompts.get(req_id)
            if prompt is None:
                continue  # completed already, or untracked
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                prompt.block_ids = list(new_blocks[gid]) if new_blocks is not None else []
            elif new_blocks is not None:
                prompt.block_ids.extend(new_blocks[gid])
            progress.append((req_id, cached.num_computed_tokens[i]))
        for req_id, computed in progress:
            prompt = self._prompts[req_id]
            if computed + scheduled.get(req_id, 0) >= len(prompt.token_ids):
                del self._prompts[req_id]
                self._completing[req_id] = self._sample(req_id, prompt.token_ids, prompt.block_ids)

    def _sample(self, req_id: str, token_ids: list[int], block_ids: list[int]) -> PendingSample:
        num_tokens = len(token_ids)
        manifest = build_manifest(
            sample_key=sample_key_for(self._extra.run_prefix, req_id),
            capture_ids=self._capture_ids,
            num_tokens=num_tokens,
            hidden_size=self._hidden_size,
            num_layers=self._num_layers,
            pp_size=self._pp_size,
            dtype=self._dtype,
            extra={
                "last_hidden_states_prenorm": LAST_HIDDEN_STATES_PRENORM,
                "request_id": req_id,
                # Lets stage 0 and the reader catch input_ids that belong to another prompt.
                INPUT_IDS_SHA256: input_ids_digest(torch.tensor(token_ids, dtype=torch.long)),
            },
        )
        # The rows of the first num_tokens slots: the blocks they occupy.
        used = -(-num_tokens // self._block_size)
        return PendingSample(
            req_id=req_id,
            block_ids=list(block_ids[:used]),
            token_ids=list(token_ids),
            manifest=manifest.to_dict(),
        )

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        rid = request.request_id
        self._prompts.pop(rid, None)
        prompt = request.prompt_token_ids
        if prompt is None:
            raise DataIntegrityError(f"request {rid} has no prompt token ids (embeds only)")
        aborted = request.status == RequestStatus.FINISHED_ABORTED
        if rid in self._handed:
            sample = self._handed.pop(rid)
            if aborted:
                # The stages publish it in any case; hold the blocks until they reported.
                logger.warning(
                    "hpctoolkit connector: request %s was aborted after its sample %s was handed to "
                    "the stages; its fragments stay in the store, unreferenced",
                    rid,
                    sample.manifest.get("sample_key"),
                )
                return True, None
        elif rid in self._completing:
            sample = self._completing[rid]
            if aborted:
                del self._completing[rid]  # never handed out: nothing is published
                return False, None
        else:
            # Never seen completing its prompt in a scheduler output (e.g. a connector unit
            # test): publish with the next step, from the blocks vLLM reports now. Never a
            # partial sample: a request finished before its last prefill chunk ran has no
            # complete set of rows.
            if aborted or request.num_computed_tokens < len(prompt):
                return False, None
            sample = self._sample(rid, list(prompt), list(block_ids))
            self._completing[rid] = sample
        used = len(sample.block_ids)
        # A request preempted after its sample was handed out recomputed into other blocks; the
        # rows were read before any block was reused (every stage reads them before the forward
        # of the next step, the first that can write a reallocated block).
        moved = getattr(request, "num_preemptions", 0) > 0
        if (not moved and list(block_ids[:used]) != sample.block_ids) or list(prompt) != sample.token_ids:
            err = DataIntegrityError(
                f"request {rid}: the sample was handed out with blocks {sample.block_ids} and "
                f"{len(sample.token_ids)} prompt tokens, but the request finished with blocks "
                f"{list(block_ids[:used])} and {len(prompt)} prompt tokens"
            )
            write_fault(self._extra.fault_dir, f"engine core, finishing request {rid}", err)
            raise err
        return True, {MANIFEST_PARAM: sample.manifest}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._cache_gid < len(block_ids):
            return False, None  # never scheduled: nothing was captured
        return self.request_finished(request, block_ids[self._cache_gid])
