"""Typed config of the vLLM engine section (`engine.*`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from hpctoolkit.config.fields import (
    Bool,
    Choice,
    Int,
    Kind,
    ListOf,
    Mapping,
    check_fields,
    require,
)

# Engine arguments that hpctoolkit derives itself; `extra_args` may not set them, because a
# contradicting value would silently change the parallel layout or the capture path.
PROTECTED_ENGINE_KEYS = frozenset(
    {
        "model",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "speculative_config",
        "kv_transfer_config",
        "enable_prefix_caching",
        "distributed_executor_backend",
        "nnodes",
        "node_rank",
        "master_addr",
        "master_port",
        "VLLM_USE_V2_MODEL_RUNNER",
        "worker_extension_cls",
    }
)

# Scheduler arguments that decide how vLLM cuts a batch of requests into steps: with
# `prefill_batch > 1` hpctoolkit sizes them (`engine.kwargs.scheduler_budget`), and a value from
# `extra_args` could split a batch differently between layouts.
BATCH_SCHEDULER_KEYS = frozenset(
    {
        "max_num_seqs",
        "max_num_batched_tokens",
        "enable_chunked_prefill",
        "long_prefill_token_threshold",
        "max_num_partial_prefills",
        "max_long_partial_prefills",
        "scheduling_policy",
        "scheduler_cls",
    }
)
# The largest prefill batch: vLLM's own default max_num_seqs for a GPU is 1024.
PREFILL_BATCH_MAX = 1024


@dataclass
class EngineConfig:
    # 0-based target layer indices whose outputs the draft reads (DFlash's `target_layer_ids`).
    # Capture ids are these +1, plus the final layer for last_hidden_states.
    target_layer_ids: list[int] = field(default_factory=list)
    num_engines: int = 1
    # One engine spans `nnodes` nodes of `gpus_per_node` GPUs: world = nnodes * gpus_per_node.
    nnodes: int = 1
    gpus_per_node: int = 1
    pp_size: int = 1
    # "bfloat16" | "float16" | "float32" | "auto" (`config/precision.py`)
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    # Prefill chunk: prompts longer than this are prefilled over several steps.
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 8
    # Prompts per `CaptureEngine.capture()` call in the callers that capture a prompt list
    # (`make run`, the Slurm leader), a multiple of `prefill_batch`: the wait for the stages'
    # publish reports is paid once per call, not per sample. The manifests of a batch
    # are handed on when the whole batch is published; a failure fails the whole batch.
    capture_batch: int = 16
    # Prompts per vLLM `generate()` call (`engine.prefill`): vLLM prefills them as one step. The
    # batches are cut at fixed engine-local sample positions (position // prefill_batch), so a
    # re-run, or another PP layout, prefills every sample with the same companions and gets the
    # same bits. 1: one request per `generate()`, as before. Above 1 the capture engine's
    # max_num_seqs and max_num_batched_tokens grow to hold a whole batch of max_model_len prompts
    # (`engine.kwargs.scheduler_budget`), and engine start refuses a KV cache that cannot.
    prefill_batch: int = 1
    # Generating engines that regenerate this engine's rows side by side, each on every N-th row
    # (`roles.engines.engine_prompts`), on the engine's one GPU: a small target leaves a GPU
    # nearly idle while one engine's scheduler works on one CPU core (SmolLM2 on an H100,
    # 2026-12-07: two engines 2.08x one). Each gets `1/N` of `gpu_memory_utilization`. The merged
    # rows are the same rows, in the same order, as one engine's. A one-GPU engine only.
    regenerate_replicas: int = 1
    # None: decided per backend (eager for a single CPU process; compiled for CPU PP, which
    # needs the compile warm-up to allocate its intermediate-tensor buffers).
    enforce_eager: bool | None = None
    # Run vLLM's EngineCore in-process (one process; faster to start on a laptop-sized machine).
    in_process: bool = True
    # CPU backend only: KV cache space per worker, GiB.
    cpu_kvcache_space_gb: int = 1
    extra_args: dict[str, Any] = field(default_factory=dict)

    KINDS: ClassVar[dict[str, Kind]] = {
        "target_layer_ids": ListOf(Int(0, 10_000)),
        "num_engines": Int(1, 100_000),
        "nnodes": Int(1, 100_000),
        "gpus_per_node": Int(1, 1024),
        "pp_size": Int(1, 1024),
        "dtype": Choice(("auto", "bfloat16", "float16", "float32")),
        "max_model_len": Int(1),
        "max_num_batched_tokens": Int(1),
        "max_num_seqs": Int(1),
        "capture_batch": Int(1),
        "prefill_batch": Int(1, PREFILL_BATCH_MAX),
        "regenerate_replicas": Int(1, 16),
        "enforce_eager": Bool(optional=True),
        "in_process": Bool(),
        "cpu_kvcache_space_gb": Int(1, 1 << 20),
        # Keys are checked against vLLM's EngineArgs at submission (`engine.kwargs.check_extra_args`).
        "extra_args": Mapping("vLLM's EngineArgs"),
    }

    @property
    def world_size(self) -> int:
        return self.nnodes * self.gpus_per_node

    @property
    def tp_size(self) -> int:
        return self.world_size // self.pp_size

    def validate(self) -> None:
        check_fields(self)
        require(
            self.world_size % self.pp_size == 0,
            "pp_size",
            f"must divide the engine world size nnodes*gpus_per_node={self.world_size}",
            self.pp_size,
        )
        require(
            self.regenerate_replicas == 1 or self.world_size == 1,
            "regenerate_replicas",
            f"must be 1 for an engine of {self.world_size} GPUs (replicas share one engine's one GPU)",
            self.regenerate_replicas,
        )
        require(
            self.capture_batch % self.prefill_batch == 0,
            "capture_batch",
            f"must be a multiple of engine.prefill_batch={self.prefill_batch} (a capture call takes "
            "whole prefill batches)",
            self.capture_batch,
        )
        split = sorted(BATCH_SCHEDULER_KEYS & set(self.extra_args)) if self.prefill_batch > 1 else []
        require(
            not split,
            "extra_args",
            f"may not set {split} with engine.prefill_batch={self.prefill_batch}: they decide how vLLM "
            "splits a prefill batch into steps (set engine.max_num_seqs / max_num_batched_tokens instead)",
            dict(self.extra_args),
        )
        clash = sorted(PROTECTED_ENGINE_KEYS & set(self.extra_args))
        require(
            not clash,
            "extra_args",
            f"may not set {clash}: hpctoolkit derives them (set engine.pp_size / engine.nnodes instead)",
            dict(self.extra_args),
        )
