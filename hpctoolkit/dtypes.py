"""Dtype names: how manifests, recipes and the CLI spell a torch dtype, and safetensors' codes.

One table for every map between them; `capture.manifest.DTYPE_BYTES` (pure, no torch) spells the
same names. torch only: `models` and `train` import it on machines without vllm or mooncake.
It stands alone at the package's top: data, models, engine, store and evaluate all spell dtypes
through it, and no one of those rooms owns the table.
"""

from __future__ import annotations

import torch

from hpctoolkit.errors import ConfigError

# name -> (torch dtype, safetensors dtype code)
_TABLE: dict[str, tuple[torch.dtype, str]] = {
    "bfloat16": (torch.bfloat16, "BF16"),
    "float16": (torch.float16, "F16"),
    "float32": (torch.float32, "F32"),
    "float64": (torch.float64, "F64"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "uint8": (torch.uint8, "U8"),
}
NAMES = tuple(_TABLE)
# What a model's weights or an engine may run in (`engine.dtype`, the exporter's `--dtype`).
WEIGHT_DTYPES = ("bfloat16", "float16", "float32")
_NAME_OF = {t: name for name, (t, _) in _TABLE.items()}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a name spells; `ConfigError` listing the names for any other."""
    try:
        return _TABLE[name][0]
    except KeyError:
        raise ConfigError(f"dtype {name!r} is not one of {sorted(_TABLE)}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a torch dtype (`torch.bfloat16` -> `bfloat16`)."""
    return _NAME_OF.get(dtype) or str(dtype).removeprefix("torch.")


def safetensors_code(dtype: torch.dtype) -> str:
    """safetensors' header code of a dtype in the table (`BF16`, `F32`, ...)."""
    try:
        return _TABLE[_NAME_OF[dtype]][1]
    except KeyError:
        raise ConfigError(f"dtype {dtype} has no safetensors code here; known: {sorted(_TABLE)}") from None
