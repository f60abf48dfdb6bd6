"""The environment an engine process gets: vLLM's variables for our backend, CPU binding, host IP.

Pure builders (the caller applies what they return); `hpctoolkit.envs` stays the registry of our
own variables.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hpctoolkit import envs

# Variables `engine_env` may set, so tests and the engine can tell ours from the user's.
ENGINE_ENV_KEYS = (
    "VLLM_TARGET_DEVICE",
    "VLLM_HOST_IP",
    "GLOO_SOCKET_IFNAME",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_USE_V2_MODEL_RUNNER",
    "VLLM_CPU_OMP_THREADS_BIND",
    "VLLM_WORKER_MULTIPROC_METHOD",
    "VLLM_USE_FLASHINFER_SAMPLER",
)


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask): on a node, the node's cores."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def _span_text(ids: list[int]) -> str:
    if len(ids) > 1 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def cpu_bind_spec(world_size: int, cores: int | Sequence[int]) -> str:
    """vLLM's `VLLM_CPU_OMP_THREADS_BIND` value splitting the cores evenly over the local workers.

    `cores` is a count (cores 0..n-1) or the core ids themselves (e.g. a node's affinity mask).
    `0|1` for two ranks on two cores, `0-1|2-3` for two ranks on four, `3` for one rank on core 3.
    """
    ids = list(range(cores)) if isinstance(cores, int) else sorted(int(c) for c in cores)
    if world_size < 1 or len(ids) < world_size:
        raise ValueError(
            f"cannot split {len(ids)} cores {ids} over {world_size} CPU workers (one core each at least)"
        )
    per = len(ids) // world_size
    return "|".join(_span_text(ids[r * per : (r + 1) * per]) for r in range(world_size))


def engine_env(
    backend: str,
    *,
    in_process: bool,
    world_size: int,
    cpu_kvcache_space_gb: int,
    host_ip: str = "127.0.0.1",
    num_cores: int | None = None,
    local_world_size: int | None = None,
    cores: Sequence[int] | None = None,
    pin_v1_runner: bool = True,
) -> dict[str, str]:
    """The environment every engine run gets. Pure: the caller applies it.

    `pin_v1_runner` sets `VLLM_USE_V2_MODEL_RUNNER=0`. A capture engine needs it at every
    `pp_size`: the connector and the patch series are tested on the V1 runner only (at PP > 1 the
    series also makes vLLM itself refuse V2 for `extract_hidden_states`, so an explicit V2 fails
    with vLLM's error). An engine that only serves (a draft under evaluation, regeneration) passes
    False and gets vLLM's own choice: on CUDA, DSpark drafts run only on V2.

    CPU binding: one entry per worker on this node (`local_world_size`, the whole world on one
    node), over `cores` (the node's cores; default: this process's affinity, or 0..num_cores-1).
    An in-process engine without explicit `cores` keeps vLLM's own ("auto") binding.
    """
    if backend not in ("cpu", "cuda"):
        raise ValueError(f"engine backend must be 'cpu' or 'cuda', got {backend!r}")
    if in_process and world_size != 1:
        raise ValueError(f"an in-process engine has exactly one worker, but the world size is {world_size}")
    local = world_size if local_world_size is None else local_world_size
    if not 1 <= local <= world_size:
        raise ValueError(f"local_world_size={local} must lie in [1, world_size={world_size}]")
    env = {
        "VLLM_HOST_IP": host_ip,
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0" if in_process else "1",
    }
    if pin_v1_runner:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    if host_ip in ("127.0.0.1", "localhost"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    if backend == "cuda":
        # CUDA cannot be used in a child forked after the parent touched it, and vLLM's own guard
        # (`_maybe_force_spawn`) looks only at `torch.cuda.is_initialized()`. A device-count probe
        # (`torch.cuda.is_available()`, anywhere above vLLM) does not set that flag, yet it arms
        # torch's fork poisoning: an EngineCore forked from such a process, and the PP/TP workers
        # it forks in turn, die with "Cannot re-initialize CUDA in forked subprocess" (PP=2 on two
        # H200s, 2026-12-04). Every CUDA engine therefore spawns, whoever probed what before.
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        # vLLM's default top-k/top-p sampler on CUDA is FlashInfer's, whose kernels come either
        # precompiled (flashinfer-cubin, flashinfer-jit-cache: several GB, not in the wheelhouse)
        # or built with nvcc at the engine's first warm-up, into ~/.cache/flashinfer: minutes on
        # every fresh node or container. On one H200, 2026-12-06, a tiny target's engine start was
        # still in "Building JIT module sampling" 84 s in, and the GPU tier ran past its limit.
        # A capture engine samples one token per request; vLLM's Triton sampler needs no build.
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    if backend == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cpu_kvcache_space_gb)
        if cores is not None or not in_process:
            # Worker processes need an explicit per-rank split ("Not enough allowed NUMA nodes"
            # otherwise), and vLLM's auto binding reserves cores a one-core node does not have.
            pool = cores if cores is not None else (range(num_cores) if num_cores else available_cores())
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind_spec(local, list(pool))
    unknown = set(env) - set(ENGINE_ENV_KEYS)
    if unknown:
        raise AssertionError(f"engine_env sets unregistered variables {sorted(unknown)}")
    return env


def gpu_memory_share() -> dict[str, float]:
    """`{"gpu_memory_utilization": x}` from HPCTOOLKIT_GPU_MEMORY_UTILIZATION, else `{}` (vLLM's 0.9).

    For GPUs that hold more than one engine at once (the GPU test tier starts several, and vLLM
    frees none within a process); a recipe's `engine.extra_args` still wins."""
    raw = envs.get(envs.HPCTOOLKIT_GPU_MEMORY_UTILIZATION.name)
    if not raw:
        return {}
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise ValueError(f"HPCTOOLKIT_GPU_MEMORY_UTILIZATION must be a fraction in (0, 1], got {raw!r}")
    return {"gpu_memory_utilization": share}


def cuda_visible() -> bool:
    """Whether torch sees a CUDA GPU, asked through NVML so that nothing is armed against fork.

    `torch.cuda.is_available()` asks the CUDA runtime for the device count by default, which
    leaves this process unable to hand CUDA to a forked child (see `engine_env`). With
    `PYTORCH_NVML_BASED_CUDA_CHECK=1` torch asks NVML instead, and falls back to the runtime only
    where NVML is missing. The one probe engine code uses.
    """
    import torch

    if not torch.cuda._is_compiled():  # a CPU build: no driver call at all
        return False
    saved = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return torch.cuda.is_available()
    finally:
        if saved is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = saved


def detect_backend() -> str:
    """'cuda' when torch sees a GPU, else 'cpu'; `HPCTOOLKIT_ENGINE_BACKEND` overrides."""
    forced = envs.get(envs.HPCTOOLKIT_ENGINE_BACKEND.name)
    if forced:
        if forced not in ("cpu", "cuda"):
            raise ValueError(f"HPCTOOLKIT_ENGINE_BACKEND must be 'cpu' or 'cuda', got {forced!r}")
        return forced
    return "cuda" if cuda_visible() else "cpu"
