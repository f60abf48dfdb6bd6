"""Every argument of a capture engine, decided without vLLM: `build_llm_kwargs` (pure) gives the
`vllm.LLM` keyword arguments and the environment to set before vLLM is imported; the leader's
`CaptureEngine` and a headless follower build theirs through the same `engine_llm_kwargs`.

Beside the engine section (`EngineConfig`) and the target, they take two small records: where the
engine's workers write (`CaptureSink`: the store, the run's key prefix, the fault records) and
what one node of a multi-node engine adds (`NodeArgs`, from `roles.context.engine_node_args`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hpctoolkit.capture import capture_ids_for, check_layer_layout, sanitize_key
from hpctoolkit.engine.config import PROTECTED_ENGINE_KEYS, EngineConfig
from hpctoolkit.engine.connector_api import EXTRA_CONFIG_KEY
from hpctoolkit.engine.env import engine_env, gpu_memory_share
from hpctoolkit.errors import ConfigError
from hpctoolkit.store.config import StoreConfig
from hpctoolkit.targets.resolve import target_num_layers

# A store's settings as the config has them, or their dict (a worker's JSON).
StoreCfg = StoreConfig | Mapping[str, Any] | None

CONNECTOR_CLASS = "HpcHiddenStatesConnector"
CONNECTOR_MODULE = "hpctoolkit.engine.connector"
WORKER_EXTENSION = "hpctoolkit.engine.worker_ext.CaptureWorkerExtension"
# How long `capture` waits for the connector to publish a finished request.
PUBLISH_WAIT_S = 120.0


def run_prefix(run_id: str, engine_index: int) -> str:
    """Sample-key prefix unique to one engine of one run, in the store-safe character set."""
    if not run_id:
        raise ConfigError("run_id must be non-empty: it keeps this run's store keys apart from others'")
    return sanitize_key(f"{run_id}-e{engine_index}")


def store_cfg_dict(store_cfg: StoreCfg) -> dict[str, Any]:
    if store_cfg is None:
        return {}
    if dataclasses.is_dataclass(store_cfg) and not isinstance(store_cfg, type):
        return dataclasses.asdict(store_cfg)
    if isinstance(store_cfg, Mapping):
        return dict(store_cfg)
    raise ConfigError(f"store config must be a StoreConfig or a mapping, got {type(store_cfg).__name__}")


@dataclass(frozen=True)
class CaptureSink:
    """Where a capture engine's workers write: the connector's settings (`connector_api.ExtraConfig`).

    `run_id` + `engine_index` prefix every sample key (`run_prefix`), so they must be unique per
    engine sharing a store. `store_address` is the master's `host:port` (None only with a
    `store_factory` that needs no master, as in unit tests); `store_cfg` a `StoreConfig` or its
    dict. Workers record a store error in `fault_dir` (one the caller reads; on a shared filesystem
    for a multi-node engine). `store_factory` and `reachability_check` (`module:attribute`)
    replace the Mooncake ones in tests.
    """

    store_address: str | None
    store_cfg: StoreCfg
    run_id: str
    engine_index: int = 0
    fault_dir: str | None = None
    store_factory: str | None = None
    reachability_check: str | None = None

    def extra_config(self) -> dict[str, Any]:
        """The connector's part of `kv_connector_extra_config` (JSON-able)."""
        store_d = store_cfg_dict(self.store_cfg)
        extra: dict[str, Any] = {
            "run_prefix": run_prefix(self.run_id, self.engine_index),
            "store_address": self.store_address,
            "store_config": store_d,
            "connect_timeout_s": float(store_d.get("connect_timeout_s", 10.0)),
            "fault_dir": self.fault_dir,
        }
        if self.store_factory is not None:
            extra["store_factory"] = self.store_factory
        if self.reachability_check is not None:
            extra["reachability_check"] = self.reachability_check
        return extra


@dataclass(frozen=True)
class NodeArgs:
    """What one node of an engine adds to the engine's arguments; the default is a one-node engine.

    A multi-node engine (`engine.nnodes > 1`) needs this node's `node_rank` and the engine's vLLM
    rendezvous (`master_addr`: the leader's host, `master_port`). `host_ip` is this node's address
    (vLLM and gloo bind it); `cores` the cores this node's workers split (default: the process's
    affinity for worker processes).
    """

    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    host_ip: str = "127.0.0.1"
    cores: tuple[int, ...] | None = None


ONE_NODE = NodeArgs()


def _checked(cfg: EngineConfig, capture_ids: Sequence[int], node: NodeArgs) -> list[int]:
    """The capture ids as ints, once the engine section and this node's place in it are valid."""
    cfg.validate()
    ids = [int(i) for i in capture_ids]
    if not ids:
        raise ConfigError("capture ids are empty")
    clash = sorted(PROTECTED_ENGINE_KEYS & set(cfg.extra_args))
    if clash:
        raise ConfigError(f"engine.extra_args may not set {clash}: hpctoolkit derives them")
    if cfg.nnodes > 1:
        if not node.master_addr or not node.master_port:
            raise ConfigError(
                f"engine.nnodes={cfg.nnodes}: a multi-node engine needs the leader's rendezvous "
                f"(master_addr={node.master_addr!r}, master_port={node.master_port!r}; the plan's "
                "engine rendezvous)"
            )
        if not 0 <= node.node_rank < cfg.nnodes:
            raise ConfigError(f"node_rank={node.node_rank} is not a node of a {cfg.nnodes}-node engine")
    elif node.node_rank != 0:
        raise ConfigError(f"node_rank={node.node_rank} given for a one-node engine (engine.nnodes=1)")
    return ids


def scheduler_budget(cfg: EngineConfig) -> tuple[int, int]:
    """`(max_num_seqs, max_num_batched_tokens)` of a capture engine.

    `engine.prefill_batch = 1`: the section's own values (a long prompt is prefilled in chunks of
    `max_num_batched_tokens`). Above 1, large enough that one scheduler pass admits a whole batch
    (`engine.prefill`): B sequences and B prompts of up to `max_model_len - 1` tokens each, plus
    one slot per request for a drafting method's extra tokens (none for `extract_hidden_states`).
    vLLM then never chunks a batch's prompts, so no layout can cut a batch into other steps.
    """
    b = cfg.prefill_batch
    if b == 1:
        return cfg.max_num_seqs, cfg.max_num_batched_tokens
    return max(cfg.max_num_seqs, b), max(cfg.max_num_batched_tokens, b * cfg.max_model_len)


def _llm_args(
    cfg: EngineConfig, model_dir: str | os.PathLike, ids: list[int], extra: dict[str, Any], *, eager: bool
) -> dict[str, Any]:
    """`vllm.LLM`'s keyword arguments of a capture engine, before `engine.extra_args`."""
    world = cfg.world_size
    seqs, tokens = scheduler_budget(cfg)
    return {
        "model": str(model_dir),
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,
        "max_num_batched_tokens": tokens,
        "max_num_seqs": seqs,
        "enable_chunked_prefill": True,
        # A prefix-cache hit would skip the forward of the shared prefix, so its rows would never
        # be written into the cache-only layer for this request.
        "enable_prefix_caching": False,
        "tensor_parallel_size": cfg.tp_size,
        "pipeline_parallel_size": cfg.pp_size,
        "distributed_executor_backend": "uni" if world == 1 else "mp",
        "enforce_eager": eager,
        "disable_log_stats": True,
        "worker_extension_cls": WORKER_EXTENSION,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}},
        },
        "kv_transfer_config": {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer",
            # vLLM draws a random engine_id otherwise; the nodes of a multi-node engine must agree.
            "engine_id": extra["run_prefix"],
            "kv_connector_extra_config": {EXTRA_CONFIG_KEY: extra},
        },
    }


def build_llm_kwargs(
    cfg: EngineConfig,
    model_dir: str | os.PathLike,
    capture_ids: Sequence[int],
    sink: CaptureSink,
    node: NodeArgs = ONE_NODE,
    *,
    backend: str = "cpu",
) -> tuple[dict[str, Any], dict[str, str]]:
    """Keyword arguments for `vllm.LLM` and the environment to set before importing vLLM.

    Pure. `capture_ids` are capture ids (already shifted, final layer appended). Protected keys
    (`PROTECTED_ENGINE_KEYS`) are derived here and may not come from `cfg.extra_args`.

    On a multi-node engine the kwargs carry vLLM's per-node keys (`follower.NODE_KEYS`, from
    `node`), and everything else is identical on every node, so a follower strips those keys and
    hands the rest to `HeadlessFollower`.
    """
    ids = _checked(cfg, capture_ids, node)
    world = cfg.world_size
    # Unset: eager for one CPU worker; CPU PP needs the compile warm-up, which is what allocates
    # the intermediate-tensor buffers.
    eager = cfg.enforce_eager if cfg.enforce_eager is not None else (backend == "cpu" and cfg.pp_size == 1)
    kwargs = _llm_args(cfg, model_dir, ids, sink.extra_config(), eager=eager)
    if backend == "cuda":
        kwargs.update(gpu_memory_share())
    kwargs.update(cfg.extra_args)
    if cfg.nnodes > 1:
        kwargs.update(
            nnodes=cfg.nnodes,
            node_rank=node.node_rank,
            master_addr=node.master_addr,
            master_port=node.master_port,
        )
    env = engine_env(
        backend,
        in_process=cfg.in_process and world == 1,
        world_size=world,
        cpu_kvcache_space_gb=cfg.cpu_kvcache_space_gb,
        host_ip=node.host_ip,
        local_world_size=cfg.gpus_per_node,
        cores=node.cores,
        pin_v1_runner=True,  # a capture engine: see engine_env
    )
    return kwargs, env


def engine_llm_kwargs(
    cfg: EngineConfig,
    model_dir: str | os.PathLike,
    sink: CaptureSink,
    node: NodeArgs = ONE_NODE,
    *,
    backend: str,
) -> tuple[list[int], dict[str, Any], dict[str, str]]:
    """(capture ids, `LLM` kwargs, env) of one engine node: what `CaptureEngine` builds on the
    leader and what a headless follower must start with (the arguments as for `build_llm_kwargs`)."""
    num_layers = target_num_layers(model_dir)
    capture_ids = capture_ids_for(cfg.target_layer_ids, num_layers)
    check_layer_layout(capture_ids, num_layers)
    kwargs, env = build_llm_kwargs(cfg, model_dir, capture_ids, sink, node, backend=backend)
    return capture_ids, kwargs, env
