"""Manifest queues between engine leaders and trainers: order, counts, stale files, failures. Pure."""

from __future__ import annotations

import json
import threading
import time

import pytest

from hpctoolkit.capture.queue import (
    QueueWriter,
    done_path,
    follow_queues,
    queue_path,
    wait_drained,
    write_drained,
)
from hpctoolkit.errors import DataIntegrityError

pytestmark = pytest.mark.timeout(30)


def line(prefix: str, i: int) -> str:
    return json.dumps({"sample_key": f"{prefix}-s{i}", "num_tokens": 3})


def keys(lines) -> list[str]:
    return [json.loads(x)["sample_key"] for x in lines]


def test_round_robin_over_engines_until_each_is_done(tmp_path):
    writers = [QueueWriter(tmp_path, i, f"job7-e{i}") for i in range(2)]
    for w in writers:
        w.reset()
    for i in range(3):
        writers[0].append(line("job7-e0", i))
    writers[1].append(line("job7-e1", 0))
    for w in writers:
        w.done()
    got = keys(follow_queues(tmp_path, ["job7-e0", "job7-e1"], expected=[3, 1], stall_timeout_s=2))
    assert got == ["job7-e0-s0", "job7-e1-s0", "job7-e0-s1", "job7-e0-s2"]


def test_follows_a_queue_while_it_is_written(tmp_path):
    w = QueueWriter(tmp_path, 0, "r-e0")
    w.reset()

    def produce() -> None:
        for i in range(5):
            time.sleep(0.02)
            w.append(line("r-e0", i))
        w.done()

    t = threading.Thread(target=produce)
    t.start()
    got = keys(follow_queues(tmp_path, ["r-e0"], stall_timeout_s=5, poll_s=0.01))
    t.join()
    assert got == [f"r-e0-s{i}" for i in range(5)]


def test_an_earlier_runs_files_are_waited_out_not_read(tmp_path):
    old = QueueWriter(tmp_path, 0, "old-e0")
    old.reset()
    old.append(line("old-e0", 0))
    old.done()
    new = QueueWriter(tmp_path, 0, "new-e0")

    def later() -> None:
        time.sleep(0.1)
        new.reset()
        new.append(line("new-e0", 0))
        new.done()

    t = threading.Thread(target=later)
    t.start()
    got = keys(follow_queues(tmp_path, ["new-e0"], stall_timeout_s=5, poll_s=0.01))
    t.join()
    assert got == ["new-e0-s0"]


def test_a_foreign_line_after_ours_fails(tmp_path):
    w = QueueWriter(tmp_path, 0, "r-e0")
    w.reset()
    w.append(line("r-e0", 0))
    with queue_path(tmp_path, 0).open("a") as f:
        f.write(line("other-e0", 1) + "\n")
    with pytest.raises(DataIntegrityError, match="another run"):
        list(follow_queues(tmp_path, ["r-e0"], stall_timeout_s=1, poll_s=0.01))


def test_failed_engine_is_reported_with_its_error(tmp_path):
    w = QueueWriter(tmp_path, 0, "r-e0")
    w.reset()
    w.append(line("r-e0", 0))
    w.failed("StoreError: master gone")
    with pytest.raises(DataIntegrityError, match="engine 0 failed: StoreError: master gone"):
        list(follow_queues(tmp_path, ["r-e0"], stall_timeout_s=1, poll_s=0.01))


def test_counts_must_agree(tmp_path):
    w = QueueWriter(tmp_path, 0, "r-e0")
    w.reset()
    w.append(line("r-e0", 0))
    w.done()
    with pytest.raises(DataIntegrityError, match="1 samples published, expected 2"):
        list(follow_queues(tmp_path, ["r-e0"], expected=[2], stall_timeout_s=1, poll_s=0.01))
    done_path(tmp_path, 0).write_text(json.dumps({"run_prefix": "r-e0", "published": 0}))
    with pytest.raises(DataIntegrityError, match="more lines"):
        list(follow_queues(tmp_path, ["r-e0"], stall_timeout_s=1, poll_s=0.01))


def test_a_stall_names_the_queues_waited_on(tmp_path):
    w = QueueWriter(tmp_path, 0, "r-e0")
    w.reset()
    w.append(line("r-e0", 0))
    with pytest.raises(DataIntegrityError, match=r"engine0\.jsonl \(1 read, no done record\)"):
        list(follow_queues(tmp_path, ["r-e0"], stall_timeout_s=0.2, poll_s=0.01))


def test_writer_refuses_a_foreign_prefix(tmp_path):
    w = QueueWriter(tmp_path, 0, "r-e0")
    w.reset()
    with pytest.raises(DataIntegrityError, match="prefix r-e0"):
        w.append(line("r-e1", 0))


def test_drained_record_is_per_run(tmp_path):
    write_drained(tmp_path, "old")
    with pytest.raises(DataIntegrityError, match="did not write"):
        wait_drained(tmp_path, "new", timeout_s=0.3)
    write_drained(tmp_path, "new")
    wait_drained(tmp_path, "new", timeout_s=1)
    stop = threading.Event()
    stop.set()
    with pytest.raises(DataIntegrityError, match="stopped"):
        wait_drained(tmp_path, "other", timeout_s=5, stop=stop)
