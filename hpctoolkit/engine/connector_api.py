"""What the capture engine's caller and `HpcHiddenStatesConnector` agree on, importable without vLLM.

* In: the connector's settings, under `EXTRA_CONFIG_KEY` of `kv_connector_extra_config`
  (`ExtraConfig`, JSON-able: they cross the process boundary to the workers). `engine.kwargs`
  writes them; the connector reads them in every role.
* Out: each finished request's manifest, under `MANIFEST_PARAM` of its `kv_transfer_params`.
* Out of band: a fatal data-path error is recorded in `fault_dir` (`write_fault`) before it is
  raised, so a caller whose worker runs in another process (`read_faults`) reports the store
  error itself rather than vLLM's generic engine-death error.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from hpctoolkit.errors import ConfigError

logger = logging.getLogger(__name__)

# Key of the manifest in a request's `kv_transfer_params`.
MANIFEST_PARAM = "hpctoolkit_manifest"
# Key of our settings inside `kv_connector_extra_config`.
EXTRA_CONFIG_KEY = "hpctoolkit"
DEFAULT_STORE_FACTORY = "hpctoolkit.store.mooncake:MooncakeStore"
DEFAULT_REACHABILITY_CHECK = "hpctoolkit.store.probe:check_reachable"


@dataclass(frozen=True)
class ExtraConfig:
    """Our part of `kv_connector_extra_config` (under key `EXTRA_CONFIG_KEY`).

    `run_prefix` is unique per engine (run id + engine index), so sample keys never collide across
    runs or engines sharing a store. `store_address` None means the factory needs no master (unit
    tests with an in-process fake); then no reachability check runs.
    """

    run_prefix: str
    store_address: str | None
    store_config: dict[str, Any] = field(default_factory=dict)
    store_factory: str = DEFAULT_STORE_FACTORY
    reachability_check: str = DEFAULT_REACHABILITY_CHECK
    connect_timeout_s: float = 10.0
    fault_dir: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_prefix": self.run_prefix,
            "store_address": self.store_address,
            "store_config": dict(self.store_config),
            "store_factory": self.store_factory,
            "reachability_check": self.reachability_check,
            "connect_timeout_s": self.connect_timeout_s,
            "fault_dir": self.fault_dir,
        }

    @classmethod
    def from_dict(cls, d: Any) -> ExtraConfig:
        if not isinstance(d, dict) or "run_prefix" not in d:
            raise ConfigError(
                f"kv_connector_extra_config[{EXTRA_CONFIG_KEY!r}] must be a mapping with run_prefix, got {d!r}"
            )
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config[{EXTRA_CONFIG_KEY!r}] has unknown keys {sorted(unknown)}"
            )
        return cls(**d)


def load_spec(spec: str) -> Any:
    """The attribute a `module:attribute` setting names (the store factory, the reachability check)."""
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"{spec!r} must be 'module:attribute'")
    return getattr(importlib.import_module(module), attr)


def write_fault(fault_dir: str | None, where: str, err: BaseException) -> None:
    """Record a fatal data-path error where the engine's caller can find it (best effort)."""
    if not fault_dir:
        return
    try:
        from hpctoolkit.rundir.atomic import write_json_atomic

        record = {"where": where, "type": type(err).__name__, "message": str(err), "time": time.time()}
        write_json_atomic(os.path.join(fault_dir, f"fault-{os.getpid()}-{time.monotonic_ns()}.json"), record)
    except OSError:
        # The original error is raised right after; a failed side-channel write must not mask it.
        logger.exception("hpctoolkit: could not write the fault record into %s", fault_dir)


def read_faults(fault_dir: str | None) -> list[dict[str, Any]]:
    """Fault records written by `write_fault`, oldest first."""
    if not fault_dir or not os.path.isdir(fault_dir):
        return []
    out = []
    for name in sorted(os.listdir(fault_dir)):
        if name.startswith("fault-") and name.endswith(".json"):
            try:
                with open(os.path.join(fault_dir, name)) as f:
                    out.append(json.load(f))
            except (OSError, ValueError):
                continue
    return sorted(out, key=lambda r: r.get("time", 0))
