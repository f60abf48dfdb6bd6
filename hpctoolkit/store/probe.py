"""Probes of a Mooncake master that need no Mooncake client: its RPC port and its HTTP server.

`check_reachable` speaks just enough of coro_rpc (the master's RPC framing) to call
`ServiceReady`, so an engine constructor can fail fast on a wrong address without registering
memory. The HTTP helpers read the master's own view (`/health`, `/metrics`, `/get_all_keys`), so
they also count objects published by processes that have since exited. Pure standard library.
"""

from __future__ import annotations

import hashlib
import re
import socket
import struct
import time
import urllib.error
import urllib.request
from typing import Any

from hpctoolkit.errors import StoreError

# coro_rpc, the master's RPC framing: a 20-byte request header, a 16-byte response header.
_CORO_RPC_MAGIC = 0x15
_REQ_HEADER = struct.Struct("<BBBBIIII")
_RESP_HEADER = struct.Struct("<BBBBIII")
# coro_rpc names a handler by the first 4 bytes of the MD5 of its qualified C++ name.
_SERVICE_READY_ID = int.from_bytes(
    hashlib.md5(b"mooncake::WrappedMasterService::ServiceReady").digest()[:4], "big"
)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise StoreError(f"Mooncake master address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def check_reachable(address: str, timeout_s: float = 10.0) -> str:
    """Fail within `timeout_s` unless a Mooncake master answers at `address` ("host:port").

    Opens one TCP connection and calls the master's `ServiceReady` RPC (coro_rpc framing), so a
    port that accepts connections but is not a Mooncake master also fails. Builds no Mooncake
    client. Returns the version string the master reports. Raises `StoreError` naming the address.
    """
    host, port = split_address(address)
    deadline = time.monotonic() + timeout_s

    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {timeout_s:g}s")
        return left

    seq = int(time.monotonic_ns() & 0xFFFFFFFF)
    try:
        with socket.create_connection((host, port), timeout=remaining()) as sock:
            sock.settimeout(remaining())
            sock.sendall(_REQ_HEADER.pack(_CORO_RPC_MAGIC, 0, 0, 0, seq, _SERVICE_READY_ID, 0, 0))
            head = _recv_exact(sock, _RESP_HEADER.size, remaining)
            magic, _ver, err, _msg, rseq, length, _attach = _RESP_HEADER.unpack(head)
            if magic != _CORO_RPC_MAGIC or rseq != seq:
                raise ConnectionError("the port answered, but not with Mooncake's coro_rpc framing")
            if err != 0:
                raise ConnectionError(f"ServiceReady returned coro_rpc error {err}")
            body = _recv_exact(sock, min(length, 4096), remaining)
    except (OSError, TimeoutError, ConnectionError) as err:
        raise StoreError(f"Mooncake master at {address} is unreachable: {err}") from err
    # The body is struct_pack'ed; the version string is its printable tail.
    m = re.search(rb"(\d+\.\d+[\w.\-+]*)$", body)
    return m.group(1).decode() if m else ""


def _recv_exact(sock: socket.socket, n: int, remaining: Any) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        sock.settimeout(remaining())
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the connection was closed before a reply arrived")
        buf += chunk
    return bytes(buf)


def _http_get(address: str, path: str, timeout_s: float) -> str:
    url = f"http://{address}{path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read().decode()
    except (OSError, urllib.error.URLError) as err:
        raise StoreError(f"Mooncake master metrics server at {address} is unreachable: {err}") from err


def master_healthy(metrics_address: str, timeout_s: float = 2.0) -> bool:
    """True when the master's HTTP `/health` says it serves."""
    try:
        return '"service_ready":true' in _http_get(metrics_address, "/health", timeout_s).replace(" ", "")
    except StoreError:
        return False


def count_keys_via_master(metrics_address: str | None, timeout_s: float = 5.0) -> int:
    """The number of keys the master holds, read from its `/metrics` (`master_key_count`).

    This asks the master itself, not our bookkeeping, so it also counts objects published by
    processes that have since exited. `metrics_address` is the master's HTTP server
    (`MasterProcess.metrics_address`, or `store.master_metrics_address` for an external master).
    """
    if not metrics_address:
        raise StoreError(
            "counting keys needs the master's metrics address (store.master_metrics_address for a "
            "master this run did not launch)"
        )
    text = _http_get(metrics_address, "/metrics", timeout_s)
    m = re.search(r"^master_key_count\s+(\d+(?:\.\d+)?)\s*$", text, re.MULTILINE)
    if m is None:
        raise StoreError(f"Mooncake master at {metrics_address}: /metrics has no master_key_count")
    return int(float(m.group(1)))


def list_keys_via_master(metrics_address: str, timeout_s: float = 5.0) -> list[str]:
    """The keys the master holds (its `/get_all_keys` endpoint), for error messages and debugging."""
    text = _http_get(metrics_address, "/get_all_keys", timeout_s)
    return [k for k in text.split() if k]
