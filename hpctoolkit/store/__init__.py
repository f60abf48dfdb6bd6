"""The store: Mooncake master launch, the `ObjectStore` transports, and per-stage fragment I/O.

Nothing here imports `mooncake` at module level; `MooncakeStore` imports it on first use.
"""

# hpctoolkit.config's schema imports store.config, which imports config.fields; entering through
# store.config first would meet a half-initialised schema. Initialising hpctoolkit.config first
# makes either import order work.
import hpctoolkit.config  # noqa: F401  (import order, see above)
from hpctoolkit.store.api import MissingKeysError, ObjectStore
from hpctoolkit.store.config import StoreConfig
from hpctoolkit.store.fragments import (
    INPUT_IDS_SHA256,
    fetch_sample,
    input_ids_digest,
    publish_stage,
)
from hpctoolkit.store.master import ExternalMaster, MasterProcess, launch_master, resolve_master
from hpctoolkit.store.memory import MemoryStore
from hpctoolkit.store.mooncake import (
    MooncakeStore,
    StoreUnavailableError,
    TransientStoreError,
    check_reachable,
    count_keys_via_master,
    list_keys_via_master,
)

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
