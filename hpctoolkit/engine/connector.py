"""`HpcHiddenStatesConnector`: vLLM KV connector that publishes captured hidden states as fragments.

Loaded out of tree through `kv_transfer_config.kv_connector_module_path` (no vLLM patch), next to
the `extract_hidden_states` speculative method. That method's `ExtractHiddenStatesModel` writes,
for every prompt token, one row per capture id into a cache-only KV layer
(`CacheOnlyAttentionLayer`, one "head" per capture id, head size = hidden size). This connector
reads those rows back out of the paged cache once a request's prefill is complete and publishes
them to the object store in the universal fragment layout of `hpctoolkit.capture.manifest`.

Lifecycle of one request (vLLM calls; `S` = scheduler-role instance, `W` = worker-role instance):

0. A request of a prefill batch (`engine.prefill`) waits until the scheduler saw its whole batch:
   `get_num_new_matched_tokens` answers vLLM "not yet" until then, so one step takes the batch.
1. Step N (the step that computes the request's last prompt token): `S.build_connector_meta`
   tracks every request's prompt, block ids and computed tokens from the scheduler output
   (`tracker.SampleTracker`), and notes that this one completes in step N: it builds the manifest
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
   gather and put run on the stage's publisher thread (`publish.Publisher`), so the step returns
   at once and the engine core, which waits for every stage's step, is not held up by a put; on
   CUDA the thread first waits for an event recorded on the worker's stream at hand-out, after
   the cache writes of step N (`publish.StageRows.ready`).
3. `S.request_finished_all_groups` (when step N's output is processed; at PP=1 before step N+1
   is scheduled): returns `(True, {"hpctoolkit_manifest": ...})`: blocks stay allocated, and
   the manifest travels to the client in `kv_transfer_params`. It checks that the block ids the
   sample was handed out with are the request's. A request finished before its prefill
   completed is never published. One aborted after its sample was handed out keeps its blocks
   until the stages reported and returns no manifest; the next step tells each stage to remove
   its fragments after its publish (`HpcConnectorMetadata.discard`). One preempted after its
   sample was handed out has that sample discarded the same way and is handed out again from its
   recompute (see `tracker.py`).
4. `W.get_finished` collects the publishes its thread completed (PP > 1) and reports a
   published request in `finished_sending` once vLLM lists it among the finished ones and no
   publish of it is still running on the thread (a preempted request is published twice). vLLM's
   `KVOutputAggregator` reports it finished only once `get_finished_count()` workers did, i.e.
   once every PP stage published; then the scheduler frees the blocks. `num_published` counts
   the samples this worker reported published; the engine reads it through the worker extension
   (`worker_ext.py`) to know when a multiprocess engine has published a sample.

Where things are decided: the stage is `get_pp_group().rank_in_group` and the TP rank
`get_tensor_model_parallel_rank()` (read in `register_kv_caches`, after distributed init);
`pp_size` is `parallel_config.pipeline_parallel_size`; the ids a stage owns are
`owned_layers(capture_ids, L, pp_rank, pp_size)` (honouring `VLLM_PP_LAYER_PARTITION`). The
cache-only layer carries the global id list (stock vLLM, PP=1) or, under the PP patch, the
stage's ids first in a layer of one name and head count on every stage (`rows.stage_heads`),
so there is one hidden-state KV group and one block table for all stages, hybrid targets
included; `rows.head_index_of` accepts both.

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

Settings arrive through `kv_connector_extra_config` (JSON-able; see `connector_api.ExtraConfig`,
which also holds the manifest's key and the fault records, importable without vLLM).
"""

from __future__ import annotations

import os
from collections import Counter
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
from hpctoolkit.capture.manifest import SUMS_ALGORITHMS
from hpctoolkit.dtypes import dtype_name
from hpctoolkit.engine.connector_api import (  # noqa: F401 -- the connector's public names
    EXTRA_CONFIG_KEY,
    MANIFEST_PARAM,
    ExtraConfig,
    load_spec,
    read_faults,
    write_fault,
)
from hpctoolkit.engine.prefill import PrefillGate
from hpctoolkit.engine.publish import Publisher, StageRows
from hpctoolkit.engine.rows import head_index_of, sample_key_for, stage_heads
from hpctoolkit.engine.tracker import PendingSample, SampleTracker
from hpctoolkit.errors import ConfigError, DataIntegrityError, StoreError
from hpctoolkit.integrity import devsum
from hpctoolkit.store.fragments import INPUT_IDS_SHA256, input_ids_digest

if TYPE_CHECKING:
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

# vLLM captures the final id (L) before the target's final norm (measured against HF).
LAST_HIDDEN_STATES_PRENORM = True
# How long a worker's shutdown waits for the publishes still queued on its publisher thread.
PUBLISHER_CLOSE_TIMEOUT_S = 30.0


@dataclass
class HpcConnectorMetadata(KVConnectorMetadata):
    """Scheduler → worker, one step: samples to publish, and samples whose fragments to remove."""

    pending: list[PendingSample] = field(default_factory=list)
    discard: list[PendingSample] = field(default_factory=list)


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
        self._dtype = dtype_name(model_config.dtype)
        parallel = vllm_config.parallel_config
        self._pp_size = int(parallel.pipeline_parallel_size)
        # A CUDA engine's stages sum their rows on the GPU, before the copy to the host
        # (`hpctoolkit.integrity.devsum`); a CPU engine's, XXH3 on the host.
        device_type = getattr(getattr(vllm_config, "device_config", None), "device_type", "cpu")
        self._sums_algorithm = devsum.ALGORITHM if device_type == "cuda" else SUMS_ALGORITHMS[0]
        # ExampleHiddenStatesConnector's helpers find the hidden-state KV group by its spec type
        # (group 0 for a dense target; its own group for hybrid targets) and its block size.
        self._cache_gid = ExampleHiddenStatesConnector._find_cache_kv_group_id(kv_cache_config)
        self._block_size = ExampleHiddenStatesConnector._get_cache_block_size(
            vllm_config, kv_cache_config, self._cache_gid
        )

        # Scheduler side: which request's sample goes to the stages, and when (tracker.py).
        self._tracker = SampleTracker(self._cache_gid, self._sample)
        # Holds a prefill batch's requests until all arrived, so one step admits them together.
        self._gate = PrefillGate()

        # Worker side (rank facts are known only after distributed init: register_kv_caches).
        self._rows: StageRows | None = None
        self._pp_rank = 0
        self._tp_rank = 0
        self._owned: list[int] = []
        self._store: Any = None
        self._publisher: Publisher | None = None
        # Publishes of a request queued on the thread and not completed yet (a preempted
        # request's sample is handed out again), and requests with a completed publish.
        self._in_flight: Counter[str] = Counter()
        self._published: set[str] = set()
        self._finished_seen: set[str] = set()
        self.num_published = 0
        if role == KVConnectorRole.WORKER and self._extra.store_address is not None:
            check = load_spec(self._extra.reachability_check)
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
        padded = stage_heads(self._capture_ids, self._num_layers, self._pp_size)
        heads = head_index_of(self._capture_ids, self._owned, kv.shape[1], padded)
        self._rows = StageRows(kv, self._block_size, heads, pp_rank)
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
            factory = load_spec(self._extra.store_factory)
            try:
                from hpctoolkit.store.config import StoreConfig

                # The client advertises this node's address (vLLM's, from the role's
                # `cluster.network`), not the one in the shared kwargs, which every node gets.
                here = os.environ.get("VLLM_HOST_IP") or self._extra.store_config.get("bind_host")
                cfg = StoreConfig(**{**self._extra.store_config, "bind_host": here})
                self._store = factory(self._extra.store_address, cfg, "writer")
            except StoreError:
                raise
            except Exception as err:
                raise StoreError(
                    f"could not create the store client for master {self._extra.store_address}: {err}"
                ) from err
        return self._store

    def _stage_rows(self, manifest: Manifest) -> StageRows:
        if self._rows is None:
            raise DataIntegrityError(f"sample {manifest.sample_key}: connector has no registered KV cache")
        return self._rows

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before this step's forward (module docstring, step 2).
        if not isinstance(connector_metadata, HpcConnectorMetadata) or self._tp_rank != 0:
            return
        for pending in connector_metadata.pending:
            manifest = Manifest.from_dict(pending.manifest)
            if self._pp_size > 1:
                if self._publisher is None:
                    self._publisher = Publisher(f"hpctoolkit-publish-pp{self._pp_rank}")
                rows = self._stage_rows(manifest)
                rows.publish_async(
                    self._publisher,
                    self._get_store,
                    pending.req_id,
                    manifest,
                    pending.block_ids,
                    pending.token_ids,
                )
                self._in_flight[pending.req_id] += 1
                continue
            rows = self._stage_rows(manifest)
            self._run_now(
                pending.req_id,
                lambda r=rows, m=manifest, p=pending: r.publish(
                    self._get_store(), m, p.block_ids, p.token_ids, r.ready()
                ),
            )
            self._published.add(pending.req_id)
        for gone in connector_metadata.discard:
            manifest = Manifest.from_dict(gone.manifest)
            if self._publisher is not None:
                self._stage_rows(manifest).remove_async(
                    self._publisher, self._get_store, gone.req_id, manifest
                )
            else:
                self._run_now(
                    gone.req_id, lambda m=manifest: self._stage_rows(m).remove(self._get_store(), m)
                )

    def _run_now(self, req_id: str, job: Any) -> None:
        try:
            job()
        except BaseException as err:
            self._record_fault(req_id, err)
            raise

    def _record_fault(self, req_id: str, err: BaseException, what: str = "publish") -> None:
        write_fault(self._extra.fault_dir, f"stage {self._pp_rank} {what} of {req_id}", err)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        for (what, req_id), err in self._publisher.completed() if self._publisher is not None else ():
            if err is not None:
                self._record_fault(req_id, err, what)
                raise err
            if what == "publish":
                self._in_flight[req_id] -= 1
                if not self._in_flight[req_id]:
                    del self._in_flight[req_id]
                self._published.add(req_id)
        # vLLM requires a reported id to have been among finished_req_ids, in this or an
        # earlier call; both normally arrive in the same step.
        self._finished_seen |= finished_req_ids
        done = {r for r in self._published & self._finished_seen if r not in self._in_flight}
        self._published -= done
        self._finished_seen -= done
        # Counted when reported, once per sample (a preempted one is published twice).
        self.num_published += len(done)
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
        if not self._gate.admit(request.request_id, getattr(request, "kv_transfer_params", None)):
            return None, False  # a prefill batch not all here yet: vLLM keeps it waiting, in order
        return 0, False  # nothing is ever loaded

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens:
            raise AssertionError("HpcHiddenStatesConnector never loads KV")

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        pending, discard = self._tracker.step(scheduler_output)
        self._gate.end_pass()  # a batch complete in this pass is admitted, whole, in the next
        return HpcConnectorMetadata(pending=pending, discard=discard)

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
            sums_algorithm=self._sums_algorithm,
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
        self._gate.finished(rid, getattr(request, "kv_transfer_params", None))
        prompt = request.prompt_token_ids
        if prompt is None:
            raise DataIntegrityError(f"request {rid} has no prompt token ids (embeds only)")
        try:
            delay, sample = self._tracker.finish(
                rid,
                list(prompt),
                list(block_ids),
                aborted=request.status == RequestStatus.FINISHED_ABORTED,
                num_computed_tokens=request.num_computed_tokens,
            )
        except DataIntegrityError as err:
            write_fault(self._extra.fault_dir, f"engine core, finishing request {rid}", err)
            raise
        return delay, (None if sample is None else {MANIFEST_PARAM: sample.manifest})

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._cache_gid < len(block_ids):
            return False, None  # never scheduled: nothing was captured
        return self.request_finished(request, block_ids[self._cache_gid])
