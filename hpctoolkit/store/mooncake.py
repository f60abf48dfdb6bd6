"""`ObjectStore` over a Mooncake master: the production transport for captured hidden states.

Lifetime
    `MooncakeStore` builds its native client lazily, on the first call that needs it, never in its
    constructor: the client registers memory, which perturbs vLLM's KV-cache memory profiling if it
    happens inside the engine constructor. What the engine constructor does instead is
    `probe.check_reachable`, which opens one TCP connection and asks the master's RPC service
    whether it is ready. It needs no client, and an unreachable or wrong address fails within
    `connect_timeout_s` (10 s by default) with a message naming the address; the native client
    would retry for about 90 s first. `close()` releases the client; it is bounded even when the
    master is already dead (the native close then blocks for about 20 s, so it is left to a daemon
    thread). That thread is started with the first client, never by `close()`: `close()` may run
    inside the garbage collector (a reader generator's `finally`), which can interrupt
    `Thread.start` in this same thread while it holds threading's internal lock; a thread started
    there waits for that lock forever (a trainer that never exited, CI of 2026-12-05).

Concurrency
    One `MooncakeStore` per process and role. Calls from several threads are serialised by a lock;
    the native client is not documented as thread-safe. A writer contributes
    `global_segment_size` bytes to the store, and the objects it publishes live in that segment:
    the writer process must outlive the reads of what it wrote. Writers put with their own segment
    preferred (`ReplicateConfig.preferred_segment`), so a stage's fragments live, and die, with
    that stage's process. A reader contributes no segment.

Data path
    A put of a key that already exists raises: Mooncake would answer success and keep the old
    bytes. Puts and gets are zero-copy: every source and destination tensor is registered with the
    client for the duration of the call (cheap over TCP, about 40 us; `register()` keeps a reused
    buffer registered instead) and moved by `batch_put_from` / `batch_get_into`. With `enable_hard_pin` objects are put with `ReplicateConfig.with_hard_pin`
    so eviction cannot take them before the trainer reads them; a Mooncake without that field gets
    one warning and the run goes on.

Failure
    Every non-zero return code raises `StoreError` naming the key, the code and its Mooncake name.
    NO_AVAILABLE_HANDLE (-200: the writer's segment is full) is retried with backoff for
    `put_retry_max_wait_seconds`, then raises. OBJECT_NOT_FOUND on a get raises `MissingKeysError`
    and on a remove counts as success. RPC failures (the master went away) raise
    `StoreUnavailableError`; a read that outlasts its object lease (LEASE_EXPIRED, -707) raises
    `TransientStoreError`; readers retry both within their retry window. The lease
    (`kv_lease_ttl_s`) must therefore exceed the time one sample's read takes on a loaded host.

`mooncake` is imported inside functions, so `hpctoolkit.store` imports where it is not installed.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from hpctoolkit.errors import StoreError
from hpctoolkit.store.api import MissingKeysError
from hpctoolkit.store.config import StoreConfig
from hpctoolkit.store.probe import check_reachable, split_address

log = logging.getLogger(__name__)

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that this module names in messages.
ERROR_NAMES = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
}
NO_AVAILABLE_HANDLE = -200
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900
LEASE_EXPIRED = -707
TRANSFER_FAIL = -800
_UNAVAILABLE_CODES = frozenset({RPC_FAIL, -1010})  # -1010: UNAVAILABLE_IN_CURRENT_STATUS

_hard_pin_warned = False

# The closer: one daemon thread per process that runs native closes (`MooncakeStore.close`).
_closes: queue.SimpleQueue[tuple[Any, threading.Event]] | None = None
_closer_lock = threading.Lock()


def _start_closer() -> queue.SimpleQueue[tuple[Any, threading.Event]]:
    """The closer's queue, its thread started on the first call (from a client's creation)."""
    global _closes
    with _closer_lock:
        if _closes is None:
            q: queue.SimpleQueue[tuple[Any, threading.Event]] = queue.SimpleQueue()
            threading.Thread(target=_close_loop, args=(q,), name="mooncake-close", daemon=True).start()
            _closes = q
        return _closes


def _close_loop(q: queue.SimpleQueue[tuple[Any, threading.Event]]) -> None:
    while True:
        store, done = q.get()
        try:
            store.close()
        except Exception as err:  # noqa: BLE001  (a close that fails leaves nothing to do)
            log.warning("Mooncake client close failed: %s", err)
        finally:
            done.set()


class TransientStoreError(StoreError):
    """A failure that may pass (readers retry it within their window, then raise)."""


class StoreUnavailableError(TransientStoreError):
    """The master stopped answering (RPC failure)."""


def code_name(code: int) -> str:
    return f"{code} ({ERROR_NAMES.get(code, 'unknown')})"


def _merge_spans(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    # A sample's destinations are views into one buffer; registering it once (not once per view)
    # avoids overlapping registrations.
    merged: list[list[int]] = []
    for ptr, size in sorted(s for s in spans if s[1] > 0):
        if merged and ptr <= merged[-1][0] + merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], ptr + size - merged[-1][0])
        else:
            merged.append([ptr, size])
    return [(p, n) for p, n in merged]


def _tensor_span(t: torch.Tensor, key: str) -> tuple[int, int]:
    if t.device.type != "cpu":
        raise StoreError(f"object {key!r}: tensor is on {t.device}, the store moves CPU memory only")
    if not t.is_contiguous():
        raise StoreError(f"object {key!r}: tensor is not contiguous")
    return t.data_ptr(), t.numel() * t.element_size()


class MooncakeStore:
    """`ObjectStore` over a Mooncake master at `address`; see the module docstring for the rules.

    `role="writer"` contributes `global_segment_size` to the store; `"reader"` contributes none.
    `local_hostname` is the address this client's transfer engine advertises to its peers: on a
    cluster, the node's own interface address (it defaults to `store.bind_host`, right on one host).
    """

    def __init__(
        self, address: str, cfg: StoreConfig, role: str = "writer", *, local_hostname: str | None = None
    ):
        if role not in ("writer", "reader"):
            raise ValueError(f"role must be 'writer' or 'reader', got {role!r}")
        split_address(address)
        self.address = address
        self.cfg = cfg
        self.role = role
        self.local_hostname = local_hostname or cfg.bind_host
        self._store: Any = None
        self._replicate: Any = None
        self._lock = threading.RLock()
        self._closed = False
        self._persistent: dict[int, int] = {}

    # -- client lifetime -------------------------------------------------------------------------

    def _client(self) -> Any:
        if self._closed:
            raise StoreError(f"Mooncake store client for {self.address} is closed")
        if self._store is None:
            # Without this the native setup retries an unreachable master for about 90 s.
            check_reachable(self.address, self.cfg.connect_timeout_s)
            from mooncake.store import MooncakeDistributedStore

            _start_closer()  # here, never in close() (see the module docstring)
            store = MooncakeDistributedStore()
            segment = self.cfg.global_segment_size if self.role == "writer" else 0
            rc = store.setup(
                self.local_hostname,
                self.cfg.metadata_server,
                segment,
                self.cfg.local_buffer_size,
                self.cfg.protocol,
                self.cfg.device_name,
                self.address,
            )
            if rc != 0:
                raise StoreError(
                    f"Mooncake client setup against master {self.address} failed: {code_name(rc)}"
                )
            self._store = store
            self._replicate = self._make_replicate_config()
            if self.role == "writer" and hasattr(self._replicate, "preferred_segment"):
                # Left to itself the master spreads objects over every writer's segment, so a
                # stage's fragments could sit in (and die with) another stage's process, and each
                # put would cross the network. Keep them in the writer's own segment.
                self._replicate.preferred_segment = store.get_hostname()
        return self._store

    def _make_replicate_config(self) -> Any:
        global _hard_pin_warned
        from mooncake.store import ReplicateConfig

        rc = ReplicateConfig()
        rc.replica_num = 1
        if self.cfg.enable_hard_pin:
            if hasattr(rc, "with_hard_pin"):
                rc.with_hard_pin = True
            elif not _hard_pin_warned:
                _hard_pin_warned = True
                warnings.warn(
                    "store.enable_hard_pin is set but the installed Mooncake's ReplicateConfig has no "
                    "with_hard_pin; fragments are published unpinned and may be evicted under pressure",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return rc

    def close(self, timeout_s: float = 3.0) -> None:
        """Release the client. Bounded: a native close that blocks (dead master) is abandoned."""
        with self._lock:
            store, self._store, self._closed = self._store, None, True
        if store is None:
            return
        closes = _closes  # started with the client; read without a lock (see the module docstring)
        if closes is None:
            store.close()
            return
        done = threading.Event()
        # SimpleQueue.put is safe inside the garbage collector; no thread is started here.
        closes.put((store, done))
        if not done.wait(timeout_s):
            log.warning("Mooncake client close against %s did not finish in %.1fs", self.address, timeout_s)

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def register(self, tensor: torch.Tensor) -> None:
        """Register `tensor` with the client until `unregister`/`close`.

        For buffers reused across calls (a staging buffer, a reused sample): calls then skip the
        per-call registration of spans inside it. Mooncake refuses a second registration of the
        same memory, so memory registered here must not also be registered on the raw client.
        """
        ptr, size = _tensor_span(tensor, "<registered buffer>")
        with self._lock:
            rc = self._client().register_buffer(ptr, size)
            if rc != 0:
                raise StoreError(f"Mooncake register_buffer of {size} bytes failed: {code_name(rc)}")
            self._persistent[ptr] = size

    def unregister(self, tensor: torch.Tensor) -> None:
        with self._lock:
            if self._persistent.pop(tensor.data_ptr(), None) is not None and self._store is not None:
                self._store.unregister_buffer(tensor.data_ptr())

    def _covered(self, ptr: int, size: int) -> bool:
        return any(p <= ptr and ptr + size <= p + n for p, n in self._persistent.items())

    @contextmanager
    def _registered(self, store: Any, spans: Sequence[tuple[int, int]]) -> Iterator[None]:
        done: list[int] = []
        try:
            for ptr, size in _merge_spans(spans):
                if self._covered(ptr, size):
                    continue
                rc = store.register_buffer(ptr, size)
                if rc != 0:
                    raise StoreError(f"Mooncake register_buffer of {size} bytes failed: {code_name(rc)}")
                done.append(ptr)
            yield
        finally:
            for ptr in done:
                store.unregister_buffer(ptr)

    # -- ObjectStore -----------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        if not items:
            return
        keys = [k for k, _ in items]
        spans = [_tensor_span(t, k) for k, t in items]
        with self._lock:
            store = self._client()
            # Mooncake answers 0 to a put on an existing key but keeps the old bytes; a reader
            # would then get stale data under a valid manifest. Refuse instead.
            present = [k for k, r in zip(keys, store.batch_is_exist(keys), strict=True) if r == 1]
            if present:
                raise StoreError(
                    f"put of {present} to Mooncake master {self.address}: already in the store, and a "
                    "put does not overwrite (sample keys must be unique among unread samples)"
                )
            with self._registered(store, spans):
                pending = list(range(len(items)))
                deadline = time.monotonic() + self.cfg.put_retry_max_wait_seconds
                delay = 0.05
                while True:
                    rcs = store.batch_put_from(
                        [keys[i] for i in pending],
                        [spans[i][0] for i in pending],
                        [spans[i][1] for i in pending],
                        self._replicate,
                    )
                    full = []
                    for i, rc in zip(pending, rcs, strict=True):
                        if rc == 0:
                            continue
                        if rc == NO_AVAILABLE_HANDLE:
                            full.append(i)
                            continue
                        cls = StoreUnavailableError if rc in _UNAVAILABLE_CODES else StoreError
                        raise cls(
                            f"put of {keys[i]!r} to Mooncake master {self.address} failed: {code_name(rc)}"
                        )
                    if not full:
                        return
                    if time.monotonic() + delay > deadline:
                        raise StoreError(
                            f"put of {[keys[i] for i in full]} to Mooncake master {self.address} still "
                            f"refused with {code_name(NO_AVAILABLE_HANDLE)} after "
                            f"{self.cfg.put_retry_max_wait_seconds:g}s: the writer's segment is full "
                            "(raise store.global_segment_size or read faster)"
                        )
                    time.sleep(delay)
                    delay = min(delay * 2, 1.0)
                    pending = full

    def get_into(self, keys: Sequence[str], dests: Sequence[torch.Tensor]) -> None:
        if len(keys) != len(dests):
            raise ValueError(f"{len(keys)} keys but {len(dests)} destinations")
        if not keys:
            return
        spans = [_tensor_span(t, k) for k, t in zip(keys, dests, strict=True)]
        with self._lock:
            store = self._client()
            with self._registered(store, spans):
                got = store.batch_get_into(list(keys), [p for p, _ in spans], [n for _, n in spans])
        missing = []
        for key, (_, want), n in zip(keys, spans, got, strict=True):
            if n == want:
                continue
            if n == OBJECT_NOT_FOUND:
                missing.append(key)
            elif n >= 0:
                raise StoreError(f"object {key!r} holds {n} bytes, destination expects {want}")
            elif n == -600:
                # The client refuses a destination smaller than the object.
                raise StoreError(f"object {key!r} is larger than its destination of {want} bytes")
            elif n == LEASE_EXPIRED:
                # The read outlasted the lease the master granted for it; the bytes may be stale.
                raise TransientStoreError(
                    f"get of {key!r} from Mooncake master {self.address} took longer than the object "
                    f"lease ({code_name(n)}); store.kv_lease_ttl_s must exceed one sample's read time"
                )
            elif n in _UNAVAILABLE_CODES:
                raise StoreUnavailableError(
                    f"get of {key!r} from Mooncake master {self.address} failed: {code_name(n)}"
                )
            else:
                hint = " (the writer whose segment holds it may have died)" if n == TRANSFER_FAIL else ""
                raise StoreError(
                    f"get of {key!r} from Mooncake master {self.address} failed: {code_name(n)}{hint}"
                )
        if missing:
            raise MissingKeysError(missing)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        with self._lock:
            res = self._client().batch_is_exist(list(keys))
        out = []
        for key, r in zip(keys, res, strict=True):
            if r < 0:
                cls = StoreUnavailableError if r in _UNAVAILABLE_CODES else StoreError
                raise cls(f"exists check of {key!r} on Mooncake master {self.address} failed: {code_name(r)}")
            out.append(r == 1)
        return out

    def remove(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        with self._lock:
            # force: a read leaves a lease (default_kv_lease_ttl) that would refuse removal (-706).
            rcs = self._client().batch_remove(list(keys), True)
        bad = [(k, rc) for k, rc in zip(keys, rcs, strict=True) if rc not in (0, OBJECT_NOT_FOUND)]
        if bad:
            key, rc = bad[0]
            cls = StoreUnavailableError if rc in _UNAVAILABLE_CODES else StoreError
            raise cls(
                f"remove of {key!r} (and {len(bad) - 1} more) on Mooncake master {self.address} "
                f"failed: {code_name(rc)}"
            )

    def health_check(self) -> int:
        """The native client's view: 0 healthy, 1 not initialised or closed, 2 master unreachable."""
        with self._lock:
            return int(self._client().health_check())
