"""`BufferPool` and `Sample.release()`: a buffer a queued device copy still reads is never handed
out again before the copy's event has completed; without events the pool works as it always did.

The events here are fakes with `query()` and `synchronize()` (what the pool reads of a
`torch.cuda.Event`); `tests/gpu/test_train_gpu.py` runs the same ordering with a real copy on a
CUDA stream held back by `torch.cuda._sleep`.
"""

from __future__ import annotations

import threading

import pytest
import torch
from store_fixtures import make_manifest

from hpctoolkit.data.sample import BufferPool, Sample

pytestmark = pytest.mark.timeout(60)


class FakeEvent:
    """A copy's event: not done until `finish()` (or `synchronize()`, which waits for it)."""

    def __init__(self, log: list[str], name: str, done: bool = False) -> None:
        self.log, self.name = log, name
        self._done = threading.Event()
        if done:
            self._done.set()

    def query(self) -> bool:
        self.log.append(f"query {self.name}")
        return self._done.is_set()

    def synchronize(self) -> None:
        self.log.append(f"synchronize {self.name}")
        if not self._done.wait(10):
            raise AssertionError(f"event {self.name} never completed")

    def finish(self) -> None:
        self._done.set()


class ReadyOnWait(FakeEvent):
    """An event whose copy completes as the host waits for it (a real event's `synchronize`)."""

    def synchronize(self) -> None:
        self.finish()
        super().synchronize()


def test_a_released_buffer_without_device_reads_is_reused_as_before():
    given = []

    class Recording(BufferPool):
        def give(self, buf, *args, **kwargs):  # type: ignore[no-untyped-def]
            given.append((args, kwargs))
            super().give(buf, *args, **kwargs)

    pool = Recording(1)
    m = make_manifest("cpu")
    a = Sample.empty_for(m, pool)
    ptr = a.input_ids.data_ptr()
    copy = a.copy_to(torch.device("cpu"))  # a host copy: nothing queued on a device
    assert torch.equal(copy.input_ids, a.input_ids) and a._reads == []
    a.release()
    assert given == [((), {})]  # give(buf) exactly as before the events: subclasses keep working
    assert pool._until == {}
    b = Sample.empty_for(m, pool)
    assert b.input_ids.data_ptr() == ptr and pool._free == []


def test_take_waits_for_the_copy_that_still_reads_the_buffer():
    log: list[str] = []
    pool = BufferPool(1)
    buf = pool.take(1000)
    copied = ReadyOnWait(log, "copy")
    pool.give(buf, until=[copied])
    got = pool.take(1000)
    log.append("handed out")
    assert got is buf
    assert log == ["query copy", "synchronize copy", "handed out"]
    assert pool._until == {} and pool._free == []


def test_a_buffer_whose_copy_has_run_is_handed_out_without_waiting():
    log: list[str] = []
    pool = BufferPool(1)
    buf = pool.take(1000)
    pool.give(buf, until=[FakeEvent(log, "copy", done=True)])
    assert pool.take(1000) is buf
    assert "synchronize copy" not in log


def test_take_prefers_a_buffer_no_copy_reads_then_waits_for_the_other():
    log: list[str] = []
    pool = BufferPool(2)
    busy, idle = torch.empty(1000, dtype=torch.uint8), torch.empty(1200, dtype=torch.uint8)
    pool.give(busy, until=[ReadyOnWait(log, "busy")])  # the smaller fit, but still being read
    pool.give(idle)
    assert pool.take(1000) is idle
    assert "synchronize busy" not in log
    assert pool.take(1000) is busy
    assert log[-1] == "synchronize busy"


def test_every_event_of_a_buffer_is_waited_for():
    log: list[str] = []
    pool = BufferPool(1)
    buf = pool.take(64)
    first, second = FakeEvent(log, "first", done=True), ReadyOnWait(log, "second")
    pool.give(buf, until=[first, second])
    assert pool.take(64) is buf
    assert "synchronize second" in log
    assert all(e._done.is_set() for e in (first, second))


def test_a_reader_thread_blocks_until_the_copy_completes():
    """`take` on another thread (a reader fetching ahead) returns the buffer only after the
    event completes; the pool's lock is not held while it waits."""
    log: list[str] = []
    pool = BufferPool(2)
    buf = pool.take(4096)
    copied = FakeEvent(log, "copy")
    pool.give(buf, until=[copied])
    got: list[torch.Tensor] = []
    reader = threading.Thread(target=lambda: got.append(pool.take(4096)))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive() and got == []  # still waiting for the copy
    other = pool.take(10)  # the lock is free: a take that fits nothing allocates meanwhile
    assert other.numel() == 10
    copied.finish()
    reader.join(10)
    assert not reader.is_alive() and got[0] is buf


def test_a_sample_released_after_a_queued_copy_gives_its_buffer_back_with_the_event():
    log: list[str] = []
    pool = BufferPool(1)
    m = make_manifest("s")
    a = Sample.empty_for(m, pool)
    ptr = a.input_ids.data_ptr()
    a.in_use_until(ReadyOnWait(log, "copy of s"))
    a.release()
    assert a._reads == [] and a._buffer is None
    a.release()  # a second release gives nothing back twice
    assert len(pool._free) == 1
    b = Sample.empty_for(m, pool)
    log.append("b handed out")
    assert b.input_ids.data_ptr() == ptr
    assert log[-2:] == ["synchronize copy of s", "b handed out"]


def test_a_full_pool_drops_the_buffer_and_its_events():
    """The dropped buffer is torch's host allocator's to free (it waits for the copy itself)."""
    log: list[str] = []
    pool = BufferPool(1)
    kept, dropped = torch.empty(100, dtype=torch.uint8), torch.empty(100, dtype=torch.uint8)
    pool.give(kept)
    pool.give(dropped, until=[FakeEvent(log, "dropped")])
    assert pool._free == [kept] and pool._until == {}
    assert pool.take(100) is kept and log == []


def test_a_copy_to_the_cpu_records_no_event():
    pool = BufferPool(1)
    a = Sample.empty_for(make_manifest("h"), pool)
    a.copy_to(torch.device("cpu"))
    assert a._reads == []
