"""The ports and bind addresses of a run's listeners, and the rule that no two share a port. Pure.

Every listener a run starts binds the data-plane address of its node (`cluster.network`;
loopback on the local backend), never all interfaces, and listens on a port picked when it
starts, not on a fixed one: two runs on one node (non-exclusive nodes, two local runs) must not
clash. The node that hosts a listener picks its port and records it in the run directory
(`ports/<listener>.json`, `roles.ports`; the Mooncake master's in `master.json`) before it
listens; the processes on other nodes wait for that record, bounded. A port the recipe names
(`store.master_port`, `store.metrics_port`) is used as given and checked here (`check_ports`).

The listeners: the Mooncake master and its metrics (on node 0); each multi-node engine's vLLM
rendezvous (on its leader's node) and, when it regenerates, its generating engine's (a rendezvous
of its own: its followers tell that it left by its port closing, so it must not be the capture
engine's, which opens right after); and the trainers' torch.distributed rendezvous (on the first
trainer node; none for one rank).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpctoolkit.errors import ConfigError

if TYPE_CHECKING:
    from hpctoolkit.store.config import StoreConfig

PICKED = "picked at start"
# The names of the listeners' port records (`RunDir.port_record`).
TRAINER_LISTENER = "trainers"


def engine_listener(engine: int, generating: bool = False) -> str:
    """The port record name of engine `engine`'s vLLM rendezvous (or its generating engine's)."""
    return f"engine{engine}" + ("-generate" if generating else "")


@dataclass(frozen=True)
class MasterPlacement:
    """The Mooncake master this run launches (None in `Plan.master` when it connects to one)."""

    node: int
    # Interface the master binds: a fixed address, or None for "the data-plane address of its
    # node" (Slurm: a loopback default would be unreachable from the other nodes).
    bind_host: str | None
    # 0: a free port is picked at start (recorded in master.json).
    port: int
    rule: str


def place_master(store: StoreConfig, node: int, local: bool) -> tuple[MasterPlacement | None, str | None]:
    """(the master this run launches on `node`, None) or (None, the external master's address)."""
    if store.master_address:
        return None, store.master_address
    loopback = store.bind_host in ("127.0.0.1", "localhost", "::1")
    port = store.master_port
    bind = store.bind_host if local or not loopback else None
    rule = f"bind {bind or 'data-plane address of its node'}, port " + (str(port) if port else PICKED)
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
