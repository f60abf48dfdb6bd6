"""`MooncakeStore.close` starts no thread: it may run inside the garbage collector (a reader
generator's `finally`), which can interrupt `Thread.start` while threading's internal lock is held
in the same thread; a thread started there never starts (a trainer hung at exit, CI 2026-12-05).
The native close runs on the closer thread started with the client, bounded as before."""

from __future__ import annotations

import threading

import pytest

from hpctoolkit.store import mooncake
from hpctoolkit.store.config import StoreConfig


class _Native:
    def __init__(self, block: threading.Event | None = None):
        self.closed = threading.Event()
        self.block = block

    def close(self) -> None:
        if self.block is not None:
            self.block.wait(10)
        self.closed.set()


def _store(native: _Native) -> mooncake.MooncakeStore:
    s = mooncake.MooncakeStore("127.0.0.1:1", StoreConfig(bind_host="127.0.0.1"), "reader")
    s._store = native  # as `_client` leaves it, after starting the closer
    mooncake._start_closer()
    return s


def test_close_runs_the_native_close_without_starting_a_thread(monkeypatch):
    native = _Native()
    s = _store(native)

    def no_thread(self):
        raise AssertionError("close() started a thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    s.close()
    assert native.closed.is_set()
    s.close()  # twice: nothing left to close


def test_a_native_close_that_blocks_is_abandoned_within_the_bound(caplog):
    release = threading.Event()
    native = _Native(block=release)
    s = _store(native)
    try:
        s.close(timeout_s=0.2)
        assert not native.closed.is_set()
        assert "did not finish" in caplog.text
    finally:
        release.set()
    assert native.closed.wait(5)


def test_a_closed_store_refuses_calls():
    s = _store(_Native())
    s.close()
    with pytest.raises(Exception, match="closed"):
        s._client()
