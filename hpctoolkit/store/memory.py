"""An in-process fake of `ObjectStore` for unit tests of the logic around the store.

It is never the only test of a path: the real Mooncake master is exercised by tests/test_store_*.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from hpctoolkit.errors import StoreError
from hpctoolkit.store.api import MissingKeysError


class MemoryStore:
    def __init__(self) -> None:
        self._objects: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.fail_puts_for: set[str] = set()

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        with self._lock:
            for key, t in items:
                if key in self.fail_puts_for:
                    raise StoreError(f"put of {key!r} failed (injected)")
                if not t.is_contiguous():
                    raise StoreError(f"put of {key!r}: tensor is not contiguous")
                self._objects[key] = t.detach().cpu().view(torch.uint8).numpy().tobytes()

    def get_into(self, keys: Sequence[str], dests: Sequence[torch.Tensor]) -> None:
        with self._lock:
            missing = [k for k in keys if k not in self._objects]
            if missing:
                raise MissingKeysError(missing)
            for key, dst in zip(keys, dests, strict=True):
                raw = self._objects[key]
                nbytes = dst.numel() * dst.element_size()
                if len(raw) != nbytes:
                    raise StoreError(f"object {key!r} holds {len(raw)} bytes, destination expects {nbytes}")
                dst.view(torch.uint8).view(-1).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def exists(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [k in self._objects for k in keys]

    def remove(self, keys: Sequence[str]) -> None:
        with self._lock:
            for k in keys:
                self._objects.pop(k, None)

    def keys(self) -> list[str]:
        with self._lock:
            return sorted(self._objects)

    def close(self) -> None:
        pass
