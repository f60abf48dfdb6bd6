"""Read ahead: fetch the next items on worker threads while the consumer works, in order.

`read_ahead(items, fetch, workers=W, depth=D)` yields `fetch(item)` for each item of `items`, in
the order of `items`, with up to `D` fetches started ahead of the consumer on `W` threads. It is
the trainer's input path (`HiddenStateDataset`, the spool's replay): the host fetches and checks
the next samples while the GPU runs the current step.

Contract
    - Order: results come out in the order of `items`, whatever order the fetches finish in. A
      fetch that raises raises at its own position, after every earlier result was handed out;
      nothing after it is handed out. So a consumer that records what it took (`data_order`) and
      resumes from that count sees the same stream again.
    - Memory: at most `depth` results are held that the consumer has not taken (started, running
      or done), plus the one it holds. A sample's buffer is the unit: the bound is `depth` of the
      largest samples.
    - `items` is iterated on a thread of its own (the producer), so a source that blocks (a
      manifest queue waiting on the capture) blocks that thread, not the consumer's earlier
      results.
    - Closing the generator (the consumer stops early: a preemption, the end of training) stops
      the producer, cancels fetches not yet started, sets `cancel` (a running fetch that waits for
      its data gives up) and waits for the running ones, so no worker writes into a buffer after
      the consumer has gone. Results fetched but never taken are
      dropped: for a store that removes what it hands out, they are the samples a resumed attempt
      captures again (as a batch read and then dropped by a preemption always was).
    - `workers <= 0` or `depth <= 0`: no threads, `fetch` runs inline (the plain loop).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

_END = object()


class _Raised:
    """The producer's exception, delivered at its position in the stream."""

    def __init__(self, err: BaseException) -> None:
        self.err = err


def read_ahead(
    items: Iterable[T],
    fetch: Callable[[T], R],
    *,
    workers: int,
    depth: int,
    name: str = "read-ahead",
    cancel: threading.Event | None = None,
) -> Iterator[R]:
    """`fetch(item)` for each of `items`, in order, `depth` ahead on `workers` threads. `cancel` is
    set when the consumer stops: a fetch waiting for its data watches it (`fetch_sample(cancel=)`),
    so stopping never waits out a store's retry bound."""
    if workers <= 0 or depth <= 0:
        for item in items:
            yield fetch(item)
        return
    slots = threading.Semaphore(depth)
    out: queue.Queue[object] = queue.Queue()
    stop = threading.Event()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name)

    def produce() -> None:
        try:
            for item in items:
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                if stop.is_set():
                    return
                out.put(pool.submit(fetch, item))
        except BaseException as err:  # noqa: BLE001  -- delivered to the consumer at this position
            out.put(_Raised(err))
            return
        out.put(_END)

    producer = threading.Thread(target=produce, name=f"{name}-producer", daemon=True)
    producer.start()
    try:
        while True:
            got = out.get()
            if got is _END:
                return
            if isinstance(got, _Raised):
                raise got.err
            assert isinstance(got, Future)
            try:
                result = got.result()
            finally:
                slots.release()
            yield result
    finally:
        stop.set()
        if cancel is not None:
            cancel.set()
        # Queued fetches that have not started are cancelled; running ones finish before we return.
        while True:
            try:
                left = out.get_nowait()
            except queue.Empty:
                break
            if isinstance(left, Future):
                left.cancel()
        pool.shutdown(wait=True, cancel_futures=True)
        # A producer blocked inside `items` (a queue waiting on the capture) is a daemon: it sees
        # `stop` at its next item and exits without starting a fetch.
