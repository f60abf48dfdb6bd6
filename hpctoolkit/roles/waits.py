"""Bounded waits of the roles, and the signal that ends a service role. Every wait names what it
waited for when it gives up."""

from __future__ import annotations

import signal
import socket
import threading
import time

from hpctoolkit.errors import StoreError
from hpctoolkit.plan.lifecycle import MASTER_START_TIMEOUT_S

# A role waits at most this long for the master, started by a step of its own at the same time:
# the lifecycle's one start-up bound for the master.
MASTER_REACH_TIMEOUT_S = MASTER_START_TIMEOUT_S


def term_event() -> threading.Event:
    """An event set when this process is asked to stop (SIGTERM from the batch script or the local
    launcher, SIGINT from a user)."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    return done


def wait_reachable(address: str, timeout_s: float) -> float:
    """Seconds until a TCP connection to host:port succeeds; StoreError naming it after timeout_s."""
    host, _, port = address.rpartition(":")
    t0 = time.monotonic()
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2):
                return time.monotonic() - t0
        except OSError as err:
            if time.monotonic() - t0 > timeout_s:
                raise StoreError(
                    f"the Mooncake master at {address} is unreachable after {timeout_s:.0f}s: {err}"
                ) from err
            time.sleep(0.2)
