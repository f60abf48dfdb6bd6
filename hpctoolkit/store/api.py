"""The narrow interface every store transport implements.

Lifetime: a transport is created lazily by its owner (never inside a vLLM engine constructor: the
Mooncake client registers buffers, which perturbs vLLM's KV-cache memory profiling) and closed by
it. Concurrency: one transport per process; calls from several threads of that process are
serialised by the transport itself.

Fail closed: every method raises `StoreError` naming the key or address at fault; nothing is ever
dropped with a warning. `remove` treats "not found" as success.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class MissingKeysError(KeyError):
    """Raised by `get_into` when keys are not (yet) in the store; `.keys` lists them."""

    def __init__(self, keys: Sequence[str]):
        super().__init__(f"missing keys: {list(keys)}")
        self.keys = list(keys)


class ObjectStore(Protocol):
    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Store each contiguous CPU tensor's bytes under its key; raise StoreError on any failure."""

    def get_into(self, keys: Sequence[str], dests: Sequence[torch.Tensor]) -> None:
        """Copy each object's bytes straight into the matching preallocated contiguous tensor.

        Raises MissingKeysError for absent keys, StoreError when an object's size differs from
        its destination's, or when the store fails.
        """

    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def remove(self, keys: Sequence[str]) -> None:
        """Force-remove; a key that is already gone counts as removed."""

    def close(self) -> None: ...
