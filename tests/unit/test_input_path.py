"""The trainer's input path: fetching ahead in order, the spool off the critical path (an index
that grows by appending, a checkpoint's barrier, a SIGKILL and a resume that lose and repeat
nothing), the throttled read record, and the replay reading ahead."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from store_fixtures import assert_sample_matches, make_manifest, publish_all

from hpctoolkit.data.dataset import HiddenStateDataset
from hpctoolkit.data.offline import (
    FORMAT,
    INDEX_NAME,
    LEGACY_INDEX_NAME,
    ShardReader,
    ShardWriter,
    keep_first,
    read_index,
)
from hpctoolkit.data.prefetch import read_ahead
from hpctoolkit.data.spool import SpoolWriter, ThrottledRecord
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.store.fragments import FetchCancelledError
from hpctoolkit.store.memory import MemoryStore

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _samples(n: int, prefix: str = "s", tokens: int = 8) -> tuple[MemoryStore, list]:
    st = MemoryStore()
    ms = [make_manifest(f"{prefix}{i}", tokens=tokens + i % 5, hidden=16) for i in range(n)]
    for m in ms:
        publish_all(st, m)
    return st, ms


# -- read_ahead ----------------------------------------------------------------------------------


def test_read_ahead_keeps_the_order_whatever_order_fetches_finish_in():
    rng = random.Random(0)
    delays = [rng.random() * 0.01 for _ in range(200)]

    def fetch(i: int) -> int:
        time.sleep(delays[i])
        return i * 10

    assert list(read_ahead(range(200), fetch, workers=6, depth=9)) == [i * 10 for i in range(200)]
    assert list(read_ahead(range(5), fetch, workers=0, depth=0)) == [0, 10, 20, 30, 40]


def test_read_ahead_holds_at_most_depth_results_the_consumer_has_not_taken():
    started: list[int] = []
    lock = threading.Lock()

    def fetch(i: int) -> int:
        with lock:
            started.append(i)
        return i

    it = read_ahead(range(100), fetch, workers=4, depth=5)
    for taken in range(1, 21):
        next(it)
        time.sleep(0.02)  # the consumer is slow: the fetchers run ahead, but only so far
        with lock:
            assert len(started) <= taken + 5
    it.close()


def test_a_failed_fetch_raises_at_its_position_after_every_earlier_result():
    def fetch(i: int) -> int:
        if i == 7:
            raise DataIntegrityError("sample 7 is bad")
        time.sleep(0.001 * (10 - i % 10))
        return i

    got: list[int] = []
    it = read_ahead(range(20), fetch, workers=4, depth=6)
    got.extend(next(it) for _ in range(7))
    with pytest.raises(DataIntegrityError, match="sample 7"):
        next(it)
    assert got == list(range(7))


def test_a_failing_source_raises_at_its_position():
    def items():
        yield from range(3)
        raise DataIntegrityError("manifest 3 is malformed")

    it = read_ahead(items(), lambda i: i, workers=2, depth=4)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(DataIntegrityError, match="manifest 3"):
        next(it)


def test_closing_early_cancels_waiting_fetches_and_waits_for_running_ones():
    cancel = threading.Event()
    running = threading.Event()
    finished: list[int] = []

    def fetch(i: int) -> int:
        if i >= 2:
            running.set()
            cancel.wait(30)  # a fetch waiting on data that will never come
        finished.append(i)
        return i

    it = read_ahead(range(10), fetch, workers=3, depth=4, cancel=cancel)
    assert [next(it), next(it)] == [0, 1]
    assert running.wait(5)
    t0 = time.monotonic()
    it.close()
    assert time.monotonic() - t0 < 5  # not the 30 s a fetch would wait for its data
    assert cancel.is_set()
    n = len(finished)
    time.sleep(0.05)
    assert len(finished) == n  # nothing runs once close returned


def test_a_fetch_waiting_for_unpublished_objects_gives_up_when_cancelled():
    from hpctoolkit.store.fragments import fetch_sample

    m = make_manifest("late", tokens=8, hidden=16)
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(FetchCancelledError):
        fetch_sample(MemoryStore(), m, retry_max_wait_s=30, cancel=cancel)
    assert time.monotonic() - t0 < 5


def test_the_dataset_reading_ahead_yields_the_manifests_order_and_counts_what_it_handed_out():
    st, ms = _samples(40)
    slow = _SlowStore(st)
    ds = HiddenStateDataset(ms, slow, retry_max_wait_s=0, read_ahead=6, workers=4, remove=False)
    it = iter(ds)
    first = [next(it) for _ in range(10)]
    assert [s.key for s in first] == [m.sample_key for m in ms[:10]]
    assert ds.state_dict()["consumed"] == 10  # handed out, not fetched ahead
    it.close()
    rest = list(HiddenStateDataset(ms, st, retry_max_wait_s=0, read_ahead=6, workers=4, skip=10))
    assert [s.key for s in rest] == [m.sample_key for m in ms[10:]]
    for s, m in zip(first + rest, ms, strict=True):
        assert_sample_matches(s, m)


class _SlowStore:
    """A store whose gets take a random few milliseconds (fetches finish out of order)."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.rng = random.Random(1)

    def get_into(self, keys, dests):
        time.sleep(self.rng.random() * 0.005)
        self.inner.get_into(keys, dests)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# -- the spool -----------------------------------------------------------------------------------


def test_index_bytes_written_per_sample_stay_constant_as_the_spool_grows(tmp_path):
    st, ms = _samples(300)
    samples = list(HiddenStateDataset(ms, st, retry_max_wait_s=0))
    w = ShardWriter(tmp_path, max_shard_bytes=3 * ms[0].nbytes)
    per_shard = []
    for s in samples:
        before, shards = w.index_bytes_written, len(w._shards)
        w.add(s)
        if len(w._shards) > shards:
            per_shard.append((w.index_bytes_written - before) / len(w._shards[-1]["samples"]))
    w.close()
    first, last = per_shard[: len(per_shard) // 10], per_shard[-len(per_shard) // 10 :]
    # The same bytes per sample at the start and at the end (key lengths differ by a digit).
    assert max(last) <= 1.1 * max(first)
    assert [s.key for s in ShardReader(tmp_path).dataset()] == [m.sample_key for m in ms]


def test_keep_first_cuts_inside_a_shard_and_appending_continues_after_the_cut(tmp_path):
    st, ms = _samples(10)
    samples = list(HiddenStateDataset(ms, st, retry_max_wait_s=0))
    with ShardWriter(tmp_path, max_shard_bytes=4 * max(m.nbytes for m in ms)) as w:
        for s in samples[:9]:
            w.add(s)
    assert [len(s["samples"]) for s in read_index(tmp_path)[0]] == [4, 4, 1]
    count, nbytes = keep_first(tmp_path, 6)
    assert (count, nbytes) == (6, sum(m.nbytes for m in ms[:6]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        INDEX_NAME,
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    assert [s.key for s in ShardReader(tmp_path).dataset()] == [f"s{i}" for i in range(6)]
    # The resumed attempt spools samples 6.. again (its engines captured them again).
    st2, ms2 = _samples(10)
    again = list(HiddenStateDataset(ms2[6:], st2, retry_max_wait_s=0))
    with ShardWriter(tmp_path, max_shard_bytes=4 * max(m.nbytes for m in ms)) as w:
        for s in again:
            w.add(s)
    replay = list(ShardReader(tmp_path).dataset())
    assert [s.key for s in replay] == [f"s{i}" for i in range(10)]
    for s, m in zip(replay, ms, strict=True):
        assert_sample_matches(s, m)
    with pytest.raises(DataIntegrityError, match="fewer than the 11"):
        keep_first(tmp_path, 11)


def test_a_legacy_whole_file_index_is_read_and_converted_when_appended_to(tmp_path):
    st, ms = _samples(4)
    samples = list(HiddenStateDataset(ms, st, retry_max_wait_s=0))
    with ShardWriter(tmp_path, max_shard_bytes=1) as w:
        for s in samples[:3]:
            w.add(s)
    shards, _ = read_index(tmp_path)
    legacy = {
        "format": FORMAT,
        "shards": [{k: s[k] for k in ("file", "samples", "nbytes")} for s in shards],
        "num_samples": 3,
    }
    (tmp_path / INDEX_NAME).unlink()
    (tmp_path / LEGACY_INDEX_NAME).write_text(json.dumps(legacy))
    assert [s.key for s in ShardReader(tmp_path).dataset()] == ["s0", "s1", "s2"]
    with ShardWriter(tmp_path, max_shard_bytes=1) as w:
        w.add(samples[3])
    assert not (tmp_path / LEGACY_INDEX_NAME).exists()
    assert [s.key for s in ShardReader(tmp_path).dataset()] == ["s0", "s1", "s2", "s3"]


def test_a_torn_last_index_line_is_not_taken_and_an_appending_writer_drops_it(tmp_path):
    st, ms = _samples(3)
    samples = list(HiddenStateDataset(ms, st, retry_max_wait_s=0))
    with ShardWriter(tmp_path, max_shard_bytes=1) as w:
        for s in samples[:2]:
            w.add(s)
    with open(tmp_path / INDEX_NAME, "ab") as f:
        f.write(b'{"file":"shard-00002.safetensors","samples":["s')  # a crash mid-append
    assert read_index(tmp_path)[1] is True
    assert [s.key for s in ShardReader(tmp_path).dataset()] == ["s0", "s1"]
    with ShardWriter(tmp_path, max_shard_bytes=1) as w:
        w.add(samples[2])
    assert read_index(tmp_path)[1] is False
    assert [s.key for s in ShardReader(tmp_path).dataset()] == ["s0", "s1", "s2"]


def test_the_spool_writer_syncs_on_request_and_surfaces_a_failed_write(tmp_path, monkeypatch):
    import hpctoolkit.data.offline as offline

    st, ms = _samples(8)
    samples = list(HiddenStateDataset(ms, st, retry_max_wait_s=0))
    w = SpoolWriter(tmp_path, max_shard_bytes=1 << 30, max_queued=2)
    for s in samples[:5]:
        w.put(s)
    w.sync()  # the checkpoint's barrier: all five durable, in one shard
    assert w.durable == 5
    assert [s.key for s in ShardReader(tmp_path).dataset()] == [f"s{i}" for i in range(5)]

    def full(path, tensors, meta):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(offline, "_write_safetensors", full)
    w.put(samples[5])
    with pytest.raises(DataIntegrityError, match="No space left"):
        w.sync()
    with pytest.raises(DataIntegrityError, match="No space left"):
        w.put(samples[6])
    # What the index names is the five complete samples, nothing of the failed shard.
    assert [s.key for s in ShardReader(tmp_path).dataset()] == [f"s{i}" for i in range(5)]


def test_the_throttled_record_writes_at_most_once_an_interval_and_while_the_reader_waits(tmp_path):
    state = {"n": 0}
    rec = ThrottledRecord(tmp_path / "read.json", lambda: dict(state), min_interval_s=0.2)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        with rec.lock:
            state["n"] += 1
        rec.touch()
        time.sleep(0.001)
    n = state["n"]
    # The reader now blocks (no more touches): the record still catches up within the interval.
    time.sleep(0.5)
    assert json.loads((tmp_path / "read.json").read_text())["n"] == n
    assert rec.writes <= 1 + 1.0 / 0.2 + 2
    rec.close()


# -- a SIGKILL while spooling, then the resume --------------------------------------------------

_SPOOLER = """
import json, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
from store_fixtures import make_manifest, publish_all
from hpctoolkit.store.memory import MemoryStore
from hpctoolkit.train.source import LiveSource
from hpctoolkit.rundir.atomic import write_json_atomic

out = Path({out!r})
start, total, every = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
st = MemoryStore()
ms = [make_manifest(f"s{{i}}", tokens=8 + i % 5, hidden=16) for i in range(total)]
for m in ms[start:]:
    publish_all(st, m)
src = LiveSource(
    "", expected=total - start, store_factory=lambda: st, retry_max_wait_s=1,
    follow=lambda: ms[start:], spool_dir=str(out / "spool"), resumed=start > 0,
    spool_shard_bytes=5 * ms[0].nbytes, read_ahead=4, fetch_workers=2,
)
n = start
for sample in src(0, 1, 0, start):
    n += 1
    if n % every == 0:
        src.sync()  # what the training loop does before it writes a checkpoint
        write_json_atomic(out / "ckpt.json", {{"trained": n}})
    print(n, flush=True)
"""


def test_a_sigkill_while_spooling_then_a_resume_loses_and_repeats_nothing(tmp_path):
    script = tmp_path / "spooler.py"
    script.write_text(_SPOOLER.format(tests=str(ROOT / "tests"), out=str(tmp_path)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    total, every = 120, 7
    proc = subprocess.Popen(
        [sys.executable, str(script), "0", str(total), str(every)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if int(line) >= 53:  # between checkpoints (49 and 56), shards half full
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    trained = json.loads((tmp_path / "ckpt.json").read_text())["trained"]
    assert trained % every == 0 and trained >= 49
    r = subprocess.run(
        [sys.executable, str(script), str(trained), str(total), str(every)],
        capture_output=True,
        text=True,
        env=env,
        timeout=90,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    replay = list(ShardReader(tmp_path / "spool" / "rank0").dataset())
    assert [s.key for s in replay] == [f"s{i}" for i in range(total)]
    rec = json.loads((tmp_path / "spool" / "read-rank0.json").read_text())
    assert rec["complete"] and rec["samples"] == total
