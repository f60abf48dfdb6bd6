"""Training data: reassembled samples, the dataset over manifests, and offline shards.

Names are resolved lazily: `hpctoolkit.store.fragments` imports `hpctoolkit.data.sample`, and the
dataset imports the store back, so an eager package import here would be circular.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HiddenStateDataset": "hpctoolkit.data.dataset",
    "as_manifest": "hpctoolkit.data.dataset",
    "ShardReader": "hpctoolkit.data.offline",
    "ShardWriter": "hpctoolkit.data.offline",
    "save_manifest_samples": "hpctoolkit.data.offline",
    "Sample": "hpctoolkit.data.sample",
    "BufferPool": "hpctoolkit.data.sample",
}

__all__ = [
    "BufferPool",
    "HiddenStateDataset",
    "Sample",
    "ShardReader",
    "ShardWriter",
    "as_manifest",
    "save_manifest_samples",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hpctoolkit.data' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
