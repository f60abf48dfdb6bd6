"""The publish path on CUDA streams: a stage's publisher thread never reads rows before they are written.

    python -m pytest tests/gpu/test_publish_gpu.py -q        # on a CUDA machine (torch only)

vLLM runs each CUDA worker on a non-blocking stream of its own; the cache writes of a sample's
last chunk are queued there, and a non-last stage gathers the rows on its publisher thread. The
GPU tests reproduce that with `torch.cuda._sleep` queued before the write on a worker stream:
the connector's own path (`StageRows.publish_async` on a `Publisher`, into an in-memory store)
must read 0 stale rows over many trials, while the same gather without the event (the code
before the fix) does read stale rows, which shows the window the sleep opens is real.
"""

from __future__ import annotations

import time

import pytest
import torch

from hpctoolkit.capture import Manifest, build_manifest
from hpctoolkit.engine.publish import Publisher, StageRows
from hpctoolkit.engine.rows import head_index_of, stage_heads
from hpctoolkit.store.memory import MemoryStore

CAPTURE_IDS, NUM_LAYERS, PP = [1, 3, 5, 6], 6, 2
HIDDEN, BLOCK, NUM_TOKENS = 256, 16, 37
TRIALS, CONTROL_TRIALS = 200, 50
SLEEP_CYCLES = 20_000_000  # about 10 ms on an H200

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _manifest(trial: int) -> Manifest:
    return build_manifest(
        sample_key=f"gpu-{trial}",
        capture_ids=CAPTURE_IDS,
        num_tokens=NUM_TOKENS,
        hidden_size=HIDDEN,
        num_layers=NUM_LAYERS,
        pp_size=PP,
        dtype="bfloat16",
        extra={},
    )


def _stale_rows(store: MemoryStore, manifest: Manifest, stage: int, value: float) -> int:
    # The stage's hidden-state rows only: not its input_ids, nor its sums object (since 2026-12-04).
    specs = [f for f in manifest.fragments if f.stage == stage]
    dests = [torch.empty(NUM_TOKENS, HIDDEN, dtype=torch.bfloat16) for _ in specs]
    store.get_into([f.key for f in specs], dests)
    return sum(int((d != value).any(dim=1).sum()) for d in dests)


def _run(use_event: bool, trials: int) -> tuple[int, int]:
    """(stale rows, rows read) over `trials` samples, each written after a sleep on a worker stream."""
    device = torch.device("cuda")
    stage = 0  # a non-last stage: it publishes on its thread (and adds input_ids)
    owned = [1, 3]
    heads = head_index_of(CAPTURE_IDS, owned, stage_heads(CAPTURE_IDS, NUM_LAYERS, PP), 2)
    blocks = 64
    kv = torch.zeros(blocks, 2, BLOCK, HIDDEN, dtype=torch.bfloat16, device=device)
    rows = StageRows(kv, BLOCK, heads, stage)
    store, publisher = MemoryStore(), Publisher("gpu-test-publisher")
    worker = torch.cuda.Stream(device)  # vLLM's worker stream: non-blocking
    torch.cuda.synchronize()
    used = -(-NUM_TOKENS // BLOCK)
    manifests = []
    for trial in range(trials):
        block_ids = [(trial * used + j) % blocks for j in range(used)]
        manifest = _manifest(trial)
        value = float(trial % 200 + 1)
        # The write's index goes to the device before the sleep: indexing with a host list copies
        # it there synchronously on the current stream, which would make this thread wait out the
        # sleep, close the window and leave the control below nothing to catch.
        index = torch.tensor(block_ids, device=device)
        with torch.cuda.stream(worker):
            # The last chunk's cache write, queued behind a long kernel on the worker stream.
            torch.cuda._sleep(SLEEP_CYCLES)
            kv.index_fill_(0, index, value)
            if use_event:
                # What bind_connector_metadata runs on the step thread.
                rows.publish_async(
                    publisher, lambda: store, str(trial), manifest, block_ids, range(NUM_TOKENS)
                )
            else:
                publisher.submit(
                    ("publish", str(trial)),
                    lambda m=manifest, b=block_ids: rows.publish(store, m, b, range(NUM_TOKENS), None),
                )
        manifests.append((manifest, value))
        deadline = time.monotonic() + 30
        while not (done := publisher.completed()):
            assert time.monotonic() < deadline, "the publisher did not finish"
            time.sleep(0.0005)
        assert done == [(("publish", str(trial)), None)], done
        worker.synchronize()
    assert publisher.close(30)
    stale = sum(_stale_rows(store, m, stage, v) for m, v in manifests)
    return stale, trials * len(owned) * NUM_TOKENS


@pytest.mark.gpu
@needs_cuda
def test_publisher_thread_reads_no_stale_rows():
    stale, total = _run(use_event=True, trials=TRIALS)
    print(f"with the event: {stale} stale rows of {total}")
    assert stale == 0


@pytest.mark.gpu
@needs_cuda
def test_the_same_gather_without_the_event_reads_stale_rows():
    """The control: the window the sleep opens is real, so the test above would catch the bug."""
    stale, total = _run(use_event=False, trials=CONTROL_TRIALS)
    print(f"without the event: {stale} stale rows of {total}")
    assert stale > 0


@pytest.mark.gpu
@needs_cuda
def test_host_copies_of_gpu_rows_are_page_locked_and_exact():
    """`host_copies` (what a CUDA stage's rows and `publish_stage` go through): a GPU tensor,
    contiguous or not, comes back in page-locked memory, bit for bit, its copy complete when the
    call returns even behind queued work; a host tensor comes back as it is."""
    from hpctoolkit.store.fragments import host_copies

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(NUM_TOKENS, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    strided = torch.randn(HIDDEN, NUM_TOKENS, device="cuda", generator=g).to(torch.bfloat16).t()
    ids = torch.arange(NUM_TOKENS)
    torch.cuda._sleep(SLEEP_CYCLES)  # queued ahead of the copies: the call must wait it out
    rows.add_(1)  # behind the sleep: the copy must read the sum, not the bytes before it
    got = host_copies([rows, strided, ids])
    assert [t.device.type for t in got] == ["cpu"] * 3
    assert got[0].is_pinned() and got[1].is_pinned() and got[1].is_contiguous()
    assert got[2].data_ptr() == ids.data_ptr()
    assert torch.equal(got[0].view(torch.int16), rows.cpu().view(torch.int16))
    assert torch.equal(got[1].view(torch.int16), strided.contiguous().cpu().view(torch.int16))
