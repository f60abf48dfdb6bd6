"""Engine arguments, environment and the connector's pure helpers: no vLLM, milliseconds."""

from __future__ import annotations

import json

import pytest
import torch

from hpctoolkit import envs
from hpctoolkit.capture import capture_ids_for, sanitize_key
from hpctoolkit.engine import env as engine_env_mod
from hpctoolkit.engine.config import PROTECTED_ENGINE_KEYS, EngineConfig
from hpctoolkit.engine.connector_api import EXTRA_CONFIG_KEY
from hpctoolkit.engine.kwargs import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    CaptureSink,
    NodeArgs,
    build_llm_kwargs,
    run_prefix,
)
from hpctoolkit.engine.rows import gather_heads, head_index_of, sample_key_for, slot_mapping
from hpctoolkit.errors import ConfigError, DataIntegrityError

pytestmark = pytest.mark.timeout(60)

IDS = [1, 3, 5, 6]


def _build(cfg: EngineConfig | None = None, backend: str = "cpu", **kw):
    """`build_llm_kwargs` with `kw` split into the sink's fields and the node's."""
    cfg = cfg or EngineConfig(target_layer_ids=[0, 2, 4])
    sink = {"store_address": "127.0.0.1:50051", "store_cfg": {"connect_timeout_s": 7.0}, "run_id": "run1"}
    sink.update({k: v for k, v in kw.items() if k in CaptureSink.__dataclass_fields__})
    node = {k: v for k, v in kw.items() if k in NodeArgs.__dataclass_fields__}
    assert not set(kw) - set(CaptureSink.__dataclass_fields__) - set(node), kw
    if "cores" in node:
        node["cores"] = tuple(node["cores"])
    return build_llm_kwargs(cfg, "/models/t", IDS, CaptureSink(**sink), NodeArgs(**node), backend=backend)


def test_capture_engine_core_arguments():
    kwargs, _ = _build()
    assert kwargs["model"] == "/models/t"
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["enable_chunked_prefill"] is True
    spec = kwargs["speculative_config"]
    assert spec["method"] == "extract_hidden_states"
    assert spec["num_speculative_tokens"] == 1
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == IDS
    kv = kwargs["kv_transfer_config"]
    assert kv["kv_connector"] == CONNECTOR_CLASS
    assert kv["kv_connector_module_path"] == CONNECTOR_MODULE
    extra = kv["kv_connector_extra_config"][EXTRA_CONFIG_KEY]
    assert extra["store_address"] == "127.0.0.1:50051"
    assert extra["connect_timeout_s"] == 7.0
    assert extra["run_prefix"] == "run1-e0"
    assert kv["engine_id"] == "run1-e0"  # identical on every node of the engine
    # Settings cross a process boundary to the workers: JSON only.
    json.dumps(kwargs)


def test_capture_ids_follow_vllm_convention():
    # 0-based layer i -> capture id i+1; the final layer L is appended for last_hidden_states.
    assert capture_ids_for([0, 2, 4], 6) == IDS
    with pytest.raises(ConfigError):
        capture_ids_for([5], 6)  # the final layer is captured separately


@pytest.mark.parametrize(
    ("nodes", "gpus", "pp", "tp"), [(1, 1, 1, 1), (1, 4, 2, 2), (1, 8, 4, 2), (1, 6, 3, 2)]
)
def test_tp_is_world_over_pp(nodes, gpus, pp, tp):
    cfg = EngineConfig(target_layer_ids=[0], nnodes=nodes, gpus_per_node=gpus, pp_size=pp)
    kwargs, env = _build(cfg, backend="cuda")
    assert kwargs["tensor_parallel_size"] == tp
    assert kwargs["pipeline_parallel_size"] == pp
    assert kwargs["tensor_parallel_size"] * kwargs["pipeline_parallel_size"] == nodes * gpus
    assert kwargs["distributed_executor_backend"] == ("uni" if nodes * gpus == 1 else "mp")
    # Several workers cannot share the caller's process.
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == ("0" if nodes * gpus == 1 else "1")


def test_pp_must_divide_world():
    with pytest.raises(ConfigError, match="pp_size"):
        _build(EngineConfig(target_layer_ids=[0], gpus_per_node=4, pp_size=3))


@pytest.mark.parametrize("key", sorted(PROTECTED_ENGINE_KEYS))
def test_protected_keys_rejected(key):
    cfg = EngineConfig(target_layer_ids=[0], extra_args={key: 1})
    with pytest.raises(ConfigError, match=key):
        _build(cfg)


def test_extra_args_pass_through():
    kwargs, _ = _build(EngineConfig(target_layer_ids=[0], extra_args={"seed": 3, "block_size": 32}))
    assert kwargs["seed"] == 3
    assert kwargs["block_size"] == 32


def test_eager_default_per_backend():
    assert _build()[0]["enforce_eager"] is True  # one CPU worker
    pp2 = EngineConfig(target_layer_ids=[0], gpus_per_node=2, pp_size=2)
    assert _build(pp2)[0]["enforce_eager"] is False  # CPU PP needs the compile warm-up
    assert _build(backend="cuda")[0]["enforce_eager"] is False
    forced = EngineConfig(target_layer_ids=[0], enforce_eager=True)
    assert _build(forced, backend="cuda")[0]["enforce_eager"] is True


def test_cpu_environment():
    _, env = _build(EngineConfig(target_layer_ids=[0], cpu_kvcache_space_gb=3))
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    assert env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert set(env) <= set(engine_env_mod.ENGINE_ENV_KEYS)
    _, cuda_env = _build(backend="cuda")
    assert "VLLM_TARGET_DEVICE" not in cuda_env


def test_cuda_engines_use_a_sampler_that_needs_no_nvcc_build():
    """FlashInfer's sampler is built with nvcc at a fresh node's first engine start (minutes, seen
    on an H200 on 2026-12-06); every CUDA engine, capture or serving, takes vLLM's Triton one."""
    from hpctoolkit.engine.env import engine_env

    _, capture = _build(backend="cuda")
    serving = engine_env("cuda", in_process=True, world_size=1, cpu_kvcache_space_gb=1, pin_v1_runner=False)
    assert capture["VLLM_USE_FLASHINFER_SAMPLER"] == serving["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in _build()[1]  # the CPU has no FlashInfer


@pytest.mark.parametrize("pp", [1, 2])
def test_capture_engines_pin_the_v1_runner_and_serving_engines_may_not(pp):
    """The rule of docs/pp-export.md: a capture engine runs V1 at every pp_size; serving keeps vLLM's choice."""
    cfg = EngineConfig(target_layer_ids=[0], gpus_per_node=pp, pp_size=pp)
    assert _build(cfg, backend="cuda")[1]["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    serving = engine_env_mod.engine_env(
        "cuda", in_process=True, world_size=1, cpu_kvcache_space_gb=1, pin_v1_runner=False
    )
    assert "VLLM_USE_V2_MODEL_RUNNER" not in serving


def test_cpu_pp_binds_cores_per_rank():
    cfg = EngineConfig(target_layer_ids=[0], gpus_per_node=2, pp_size=2)
    _, env = _build(cfg, cores=[0, 1])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    assert engine_env_mod.cpu_bind_spec(2, 4) == "0-1|2-3"
    with pytest.raises(ValueError, match="cores"):
        engine_env_mod.cpu_bind_spec(4, 2)


def test_env_registry():
    assert "HPCTOOLKIT_CACHE" in envs.registered()
    with pytest.raises(KeyError, match="not a registered"):
        envs.get("HPCTOOLKIT_NOPE")


def _two_nodes(**kw):
    cfg = EngineConfig(target_layer_ids=[0], nnodes=2, gpus_per_node=1, pp_size=2)
    node = {"master_addr": "node2", "master_port": 29600, **kw}
    return _build(cfg, **node)


def test_multinode_needs_the_rendezvous_and_a_valid_rank():
    cfg = EngineConfig(target_layer_ids=[0], nnodes=2, gpus_per_node=1, pp_size=2)
    with pytest.raises(ConfigError, match="master_addr"):
        _build(cfg)
    with pytest.raises(ConfigError, match="node_rank=2"):
        _two_nodes(node_rank=2)
    with pytest.raises(ConfigError, match="one-node engine"):
        _build(node_rank=1)


def test_multinode_nodes_differ_only_in_node_keys():
    from hpctoolkit.engine.follower import NODE_KEYS, check_node_invariant

    leader, lenv = _two_nodes(node_rank=0, cores=[1])
    follower, fenv = _two_nodes(node_rank=1, cores=[0])
    assert (leader["nnodes"], leader["node_rank"], follower["node_rank"]) == (2, 0, 1)
    assert leader["master_addr"] == follower["master_addr"] == "node2"
    assert leader["master_port"] == follower["master_port"] == 29600
    assert leader["distributed_executor_backend"] == "mp"
    shared = {k: v for k, v in leader.items() if k not in NODE_KEYS}
    assert shared == {k: v for k, v in follower.items() if k not in NODE_KEYS}
    # Pinned, so every node's KVTransferConfig agrees (vLLM draws a random id otherwise).
    assert (
        leader["kv_transfer_config"]["engine_id"] == follower["kv_transfer_config"]["engine_id"] == "run1-e0"
    )
    check_node_invariant(shared)
    # One binding entry per local worker, over this node's own cores.
    assert (lenv["VLLM_CPU_OMP_THREADS_BIND"], fenv["VLLM_CPU_OMP_THREADS_BIND"]) == ("1", "0")
    assert {k: v for k, v in lenv.items() if k != "VLLM_CPU_OMP_THREADS_BIND"} == {
        k: v for k, v in fenv.items() if k != "VLLM_CPU_OMP_THREADS_BIND"
    }


def test_node_binding_splits_the_nodes_cores_over_its_local_workers():
    cfg = EngineConfig(target_layer_ids=[0], nnodes=2, gpus_per_node=2, pp_size=2)
    _, env = _build(cfg, master_addr="h", master_port=1, node_rank=1, cores=[4, 5, 6, 7])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "4-5|6-7"
    assert engine_env_mod.cpu_bind_spec(1, [3]) == "3"
    assert engine_env_mod.cpu_bind_spec(2, [0, 2, 4, 6]) == "0,2|4,6"
    with pytest.raises(ValueError, match="cores"):
        _build(cfg, master_addr="h", master_port=1, cores=[0])
    # An in-process engine keeps vLLM's own binding unless the node's cores are given.
    assert "VLLM_CPU_OMP_THREADS_BIND" not in _build()[1]
    assert _build(cores=[1])[1]["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_host_ip_is_the_nodes_address():
    _, env = _two_nodes(host_ip="10.0.0.7", cores=[0])
    assert env["VLLM_HOST_IP"] == "10.0.0.7"
    assert "GLOO_SOCKET_IFNAME" not in env  # lo only for a loopback address


def test_sink_names_the_fault_directory_and_the_test_hooks():
    kwargs, _ = _build(fault_dir="/scratch/run/faults/engine3", engine_index=3, store_factory="m:f")
    extra = kwargs["kv_transfer_config"]["kv_connector_extra_config"][EXTRA_CONFIG_KEY]
    assert extra["fault_dir"] == "/scratch/run/faults/engine3"
    assert extra["run_prefix"] == "run1-e3" and extra["store_factory"] == "m:f"
    assert "reachability_check" not in extra  # the connector's default


def test_run_prefix_is_store_safe_and_engine_unique():
    assert run_prefix("r1", 0) != run_prefix("r1", 1)
    p = run_prefix("my run/with:odd", 0)
    assert sanitize_key(p) == p
    with pytest.raises(ConfigError):
        run_prefix("", 0)


def test_sample_key_sanitised_and_prefixed():
    key = sample_key_for("run1-e0", "cmpl-7/a b")
    assert key.startswith("run1-e0-")
    assert sanitize_key(key) == key
    # Distinct request ids stay distinct after sanitising.
    assert sample_key_for("p", "a/b") != sample_key_for("p", "a_b")
    with pytest.raises(ConfigError):
        sample_key_for("bad prefix", "0")


def test_store_config_object_accepted():
    from hpctoolkit.store.config import StoreConfig

    kwargs, _ = _build(store_cfg=StoreConfig(connect_timeout_s=4.0))
    extra = kwargs["kv_transfer_config"]["kv_connector_extra_config"][EXTRA_CONFIG_KEY]
    assert extra["connect_timeout_s"] == 4.0
    assert extra["store_config"]["connect_timeout_s"] == 4.0


def test_slot_mapping_follows_block_table():
    assert slot_mapping([3, 1], 4, 6).tolist() == [12, 13, 14, 15, 4, 5]
    with pytest.raises(DataIntegrityError):
        slot_mapping([3], 4, 5)


def test_head_index_global_and_local_layouts():
    # Stock vLLM: heads follow the global capture-id list, whatever the stage owns.
    assert head_index_of([1, 3, 5, 6], [5, 6], 4) == {5: 2, 6: 3}
    # A per-stage cache layer (PP patch): heads follow the stage's own ids.
    assert head_index_of([1, 3, 5, 6], [5, 6], 2) == {5: 0, 6: 1}
    with pytest.raises(DataIntegrityError, match="heads"):
        head_index_of([1, 3, 5, 6], [5, 6], 3)


@pytest.mark.parametrize("physical", ["contiguous", "strided-view"])
def test_gather_heads_reads_each_ids_rows_at_the_slots_and_copies(physical):
    blocks, heads, bs, hidden = 5, 3, 4, 2
    n = blocks * heads * bs * hidden
    if physical == "contiguous":
        kv = torch.arange(n, dtype=torch.float32).reshape(blocks, heads, bs, hidden)
    else:  # a backend storing [num_blocks, block_size, num_heads, hidden], handed out as a view
        kv = torch.arange(n, dtype=torch.float32).reshape(blocks, bs, heads, hidden).transpose(1, 2)
    slots = slot_mapping([2, 0], bs, 6)
    rows = gather_heads(kv, slots, {7: 2, 3: 0})
    assert list(rows) == [7, 3]
    for k, h in ((7, 2), (3, 0)):
        assert rows[k].shape == (6, hidden) and rows[k].is_contiguous()
        for t, s in enumerate(slots.tolist()):
            assert torch.equal(rows[k][t], kv[s // bs, h, s % bs])
    kv.zero_()
    assert all(r.abs().sum() > 0 for r in rows.values())  # copies: freed blocks may be reused


def test_generating_engine_nodes_differ_only_in_node_keys(tmp_path):
    """A multi-node engine's generating engine: leader and follower build one `LLM` dict but for
    the node keys, on the rendezvous they are given, without the capture parts."""
    from hpctoolkit.engine.follower import NODE_KEYS
    from hpctoolkit.engine.regenerate import CAPTURE_ONLY_KEYS, generation_kwargs, generator_llm_kwargs

    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4}')
    cfg = EngineConfig(target_layer_ids=[0], nnodes=2, gpus_per_node=1, pp_size=2)
    built = [
        generation_kwargs(
            cfg,
            tmp_path,
            NodeArgs(r, "198.18.0.13", 29700, host_ip=f"198.18.0.1{3 + r}", cores=(r,)),
            backend="cpu",
        )
        for r in (0, 1)
    ]
    (lead, lenv), (follow, fenv) = built
    assert not set(CAPTURE_ONLY_KEYS) & set(lead)
    assert lead["master_port"] == follow["master_port"] == 29700
    assert (lead["node_rank"], follow["node_rank"]) == (0, 1)

    def strip(kw):
        return {k: v for k, v in generator_llm_kwargs(tmp_path, 7, 256, kw).items() if k not in NODE_KEYS}

    assert strip(lead) == strip(follow)
    assert strip(lead)["seed"] == 7 and strip(lead)["max_model_len"] == 256
    assert lenv["VLLM_HOST_IP"] == "198.18.0.13" and fenv["VLLM_HOST_IP"] == "198.18.0.14"


# ------------------------------------------------------------ CUDA engines spawn their workers
# PP=2 on two H200s (2026-12-04) died in vLLM's workers with "Cannot re-initialize CUDA in forked
# subprocess": a CUDA probe above vLLM arms torch's fork poisoning without setting the flag vLLM's
# own spawn guard reads. Every engine we start on CUDA must spawn, whatever probed CUDA before.


@pytest.mark.parametrize(("nodes", "pp"), [(1, 1), (1, 2), (2, 2)])
def test_every_cuda_capture_engine_node_spawns_its_workers(nodes, pp):
    """Leader and headless follower nodes (one `engine_llm_kwargs` call) at every layout."""
    cfg = EngineConfig(target_layer_ids=[0], nnodes=nodes, gpus_per_node=pp // nodes, pp_size=pp)
    for rank in range(nodes):
        node = {"node_rank": rank, "master_addr": "n1", "master_port": 29600} if nodes > 1 else {}
        _, env = _build(cfg, backend="cuda", **node)
        assert env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    # vLLM-CPU is left to fork: nothing CUDA is in the way and a fork starts faster.
    assert "VLLM_WORKER_MULTIPROC_METHOD" not in _build(cfg, backend="cpu", **node)[1]


def test_cuda_generating_and_serving_engines_spawn_their_workers(tmp_path, monkeypatch):
    from hpctoolkit.engine.regenerate import generation_kwargs
    from hpctoolkit.evaluate import serve

    (tmp_path / "config.json").write_text('{"num_hidden_layers": 4}')
    cfg = EngineConfig(target_layer_ids=[0], gpus_per_node=2, pp_size=2)
    assert generation_kwargs(cfg, tmp_path, backend="cuda")[1]["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    # The one-device generator and the draft's serving engine take their backend from the probe.
    monkeypatch.setattr(engine_env_mod, "cuda_visible", lambda: True)
    monkeypatch.delenv("HPCTOOLKIT_ENGINE_BACKEND", raising=False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    monkeypatch.setattr(serve, "detect_backend", engine_env_mod.detect_backend)
    for k in engine_env_mod.ENGINE_ENV_KEYS:
        monkeypatch.delenv(k, raising=False)
    serve._engine_environment()
    import os

    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


def test_the_cuda_probe_asks_nvml_and_restores_the_environment(monkeypatch):
    """`cuda_visible` must not go through the CUDA runtime's device count (that arms the fork
    poisoning); torch asks NVML when PYTORCH_NVML_BASED_CUDA_CHECK=1, and the caller's value stays."""
    import os

    seen = []
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(
        torch.cuda,
        "is_available",
        lambda: seen.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")) or True,
    )
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    assert engine_env_mod.cuda_visible() is True
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    assert engine_env_mod.cuda_visible() is True
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"
    assert seen == ["1", "1"]
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: False)
    assert engine_env_mod.cuda_visible() is False  # a CPU build: no driver call at all


def test_a_shared_gpu_gives_each_cuda_engine_its_share(monkeypatch):
    monkeypatch.setenv("HPCTOOLKIT_GPU_MEMORY_UTILIZATION", "0.2")
    assert _build(backend="cuda")[0]["gpu_memory_utilization"] == 0.2
    assert "gpu_memory_utilization" not in _build(backend="cpu")[0]
    mine = EngineConfig(target_layer_ids=[0], extra_args={"gpu_memory_utilization": 0.35})
    assert _build(mine, backend="cuda")[0]["gpu_memory_utilization"] == 0.35  # the recipe wins
    for bad in ("0", "1.5", "half"):
        monkeypatch.setenv("HPCTOOLKIT_GPU_MEMORY_UTILIZATION", bad)
        with pytest.raises(ValueError, match="HPCTOOLKIT_GPU_MEMORY_UTILIZATION must be a fraction"):
            _build(backend="cuda")
    monkeypatch.delenv("HPCTOOLKIT_GPU_MEMORY_UTILIZATION")
    assert "gpu_memory_utilization" not in _build(backend="cuda")[0]  # vLLM's own default
