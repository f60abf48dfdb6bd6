"""The ports and bind addresses of a run's listeners, and the rule that no two share a port. Pure.

Ports are fixed rules rather than picked at start: processes on other nodes must know them before
the process that listens on them is up. The listeners `placement.make_plan` places: the Mooncake
master and its metrics, each engine's vLLM rendezvous (on its leader's node) and, for a multi-node
engine that regenerates, its generating engine's, and the trainers' torch.distributed rendezvous
(on the first trainer node). It checks them with `check_ports`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpctoolkit.errors import ConfigError

if TYPE_CHECKING:
    from hpctoolkit.store.config import StoreConfig

STORE_DEFAULT_PORT = 50051  # mooncake_master's own default
ENGINE_PORT_BASE = 29600  # engine e's vLLM rendezvous: ENGINE_PORT_BASE + e (unique on one host)
# A multi-node engine that regenerates first runs a generating engine over the same nodes, with a
# rendezvous of its own: its followers tell that it left by its port closing, so it must not be
# the capture engine's, which opens right after.
REGENERATE_PORT_OFFSET = 100
TRAINER_PORT = 29500  # torch.distributed rendezvous of the FSDP ranks


@dataclass(frozen=True)
class MasterPlacement:
    """The Mooncake master this run launches (None in `Plan.master` when it connects to one)."""

    node: int
    # Interface the master binds: a fixed address, or None for "the host name of its node" (Slurm:
    # a loopback default would be unreachable from the other nodes).
    bind_host: str | None
    # 0 only on the local backend: a free port is picked at start.
    port: int
    rule: str


def place_master(store: StoreConfig, node: int, local: bool) -> tuple[MasterPlacement | None, str | None]:
    """(the master this run launches on `node`, None) or (None, the external master's address)."""
    if store.master_address:
        return None, store.master_address
    loopback = store.bind_host in ("127.0.0.1", "localhost", "::1")
    if local:
        port = store.master_port
        rule = f"bind {store.bind_host}, port " + (str(port) if port else "picked free at start")
        return MasterPlacement(node, store.bind_host, port, rule), None
    port = store.master_port or STORE_DEFAULT_PORT
    bind = None if loopback else store.bind_host
    rule = f"bind {bind or 'host of its node'}:{port}"
    return MasterPlacement(node, bind, port, rule), None


def check_ports(listeners: Iterable[tuple[int, int, str]]) -> None:
    """No two of `(node, port, what)` listen on one port of one node (port 0 is picked at start)."""
    taken: dict[tuple[int, int], str] = {}
    for node, port, what in listeners:
        if port == 0:
            continue
        other = taken.setdefault((node, port), what)
        if other != what:
            raise ConfigError(
                f"{what} and {other} both listen on port {port} of node n{node}; give one another port"
            )
