"""The store: Mooncake master launch, the `ObjectStore` transports, and per-stage fragment I/O.

Nothing here imports `mooncake` at module level; `MooncakeStore` imports it on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

# Names resolve on first use: the recipe schema imports `store.config`, and loading a recipe must
# not pay for torch (which the transports and fragment I/O need).
_EXPORTS = {
    "MissingKeysError": "hpctoolkit.store.api",
    "ObjectStore": "hpctoolkit.store.api",
    "StoreConfig": "hpctoolkit.store.config",
    "INPUT_IDS_SHA256": "hpctoolkit.store.fragments",
    "fetch_sample": "hpctoolkit.store.fragments",
    "input_ids_digest": "hpctoolkit.store.fragments",
    "publish_stage": "hpctoolkit.store.fragments",
    "ExternalMaster": "hpctoolkit.store.master",
    "MasterProcess": "hpctoolkit.store.master",
    "launch_master": "hpctoolkit.store.master",
    "resolve_master": "hpctoolkit.store.master",
    "MemoryStore": "hpctoolkit.store.memory",
    "MooncakeStore": "hpctoolkit.store.mooncake",
    "StoreUnavailableError": "hpctoolkit.store.mooncake",
    "TransientStoreError": "hpctoolkit.store.mooncake",
    "check_reachable": "hpctoolkit.store.mooncake",
    "count_keys_via_master": "hpctoolkit.store.mooncake",
    "list_keys_via_master": "hpctoolkit.store.mooncake",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'hpctoolkit.store' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


__all__ = [
    "INPUT_IDS_SHA256",
    "ExternalMaster",
    "MasterProcess",
    "MemoryStore",
    "MissingKeysError",
    "MooncakeStore",
    "ObjectStore",
    "StoreConfig",
    "StoreUnavailableError",
    "TransientStoreError",
    "check_reachable",
    "count_keys_via_master",
    "fetch_sample",
    "input_ids_digest",
    "launch_master",
    "list_keys_via_master",
    "publish_stage",
    "resolve_master",
]
