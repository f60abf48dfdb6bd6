"""The store against a real mooncake_master launched by the test (127.0.0.1, automatic ports).

Writers run in separate processes, as in production: the objects live in the writer's segment.
Timings are printed (`pytest -s`) so the fault figures can be read off a run.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from store_fixtures import (
    WriterProc,
    assert_sample_matches,
    make_manifest,
    master,  # noqa: F401  (fixture)
    needs_mooncake,
    publish_all,
    small_store_cfg,
    stage_payload,
    tensor_for,
    unsummed,
)

from hpctoolkit.data.dataset import HiddenStateDataset
from hpctoolkit.errors import DataIntegrityError, StoreError
from hpctoolkit.store import fragments
from hpctoolkit.store.mooncake import MooncakeStore, StoreUnavailableError
from hpctoolkit.store.mooncake_master import launch_master, pick_free_port
from hpctoolkit.store.probe import check_reachable, count_keys_via_master, list_keys_via_master

pytestmark = [pytest.mark.real, needs_mooncake]


@pytest.fixture(scope="module")
def reader(master):  # noqa: F811
    store = MooncakeStore(master.address, small_store_cfg(), role="reader")
    yield store
    store.close()


@pytest.fixture(scope="module")
def writer(master):  # noqa: F811
    # An in-process writer for the fault tests that need no second process.
    store = MooncakeStore(master.address, small_store_cfg(), role="writer")
    yield store
    store.close()


# -- reachability ---------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_check_reachable_answers_for_a_live_master(master):  # noqa: F811
    version = check_reachable(master.address, timeout_s=5)
    assert version  # the master reports its version through ServiceReady


@pytest.mark.timeout(60)
def test_unreachable_master_fails_fast_naming_the_address():
    port = pick_free_port("127.0.0.1")  # nothing listens there
    address = f"127.0.0.1:{port}"
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=address):
        check_reachable(address, timeout_s=10)
    closed_s = time.monotonic() - t0
    # A client's first use goes through the same check, not through the native 90 s retry loop.
    store = MooncakeStore(address, small_store_cfg(connect_timeout_s=10), role="writer")
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=address):
        store.put_many([("k", torch.zeros(4))])
    first_use_s = time.monotonic() - t0
    print(f"\nunreachable master: check {closed_s:.3f}s, writer first use {first_use_s:.3f}s")
    assert closed_s < 10 and first_use_s < 10


@pytest.mark.timeout(60)
def test_silent_listener_is_not_taken_for_a_master():
    # A port that accepts and never answers (a wrong service, a hung master) must fail in time.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    conns: list[socket.socket] = []
    t = threading.Thread(target=lambda: conns.append(srv.accept()[0]), daemon=True)
    t.start()
    address = f"127.0.0.1:{srv.getsockname()[1]}"
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=address):
        check_reachable(address, timeout_s=1.5)
    assert time.monotonic() - t0 < 5
    srv.close()
    for c in conns:
        c.close()


# -- data path ------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_two_stage_writers_in_separate_processes_roundtrip_bitwise_and_leave_no_keys(
    master,  # noqa: F811
    reader,
    tmp_path,
):
    manifests = [make_manifest(f"rt{i}", tokens=24, hidden=64) for i in range(3)]
    dicts = [m.to_dict() for m in manifests]
    writers = [
        WriterProc(
            tmp_path / f"stage{s}", "publish", {"address": master.address, "stages": [s], "manifests": dicts}
        )
        for s in range(2)
    ]
    try:
        for w in writers:
            w.wait_for("published", 90)
        assert count_keys_via_master(master.metrics_address) == sum(len(m.all_objects) for m in manifests)
        ds = HiddenStateDataset(dicts, reader, retry_max_wait_s=5)
        t0 = time.monotonic()
        got = list(ds)
        print(f"\nfetched {len(got)} samples in {time.monotonic() - t0:.3f}s")
        assert [s.key for s in got] == [m.sample_key for m in manifests]
        for s, m in zip(got, manifests, strict=True):
            assert_sample_matches(s, m)
        # Counted by the master itself, while the writers (and their segments) are still alive.
        assert count_keys_via_master(master.metrics_address) == 0
        assert list_keys_via_master(master.metrics_address) == []
    finally:
        for w in writers:
            w.signal("release")
        for w in writers:
            assert w.wait(30) == 0, w.output()


@pytest.mark.timeout(60)
def test_missing_fragment_raises_naming_the_key_after_the_retry_window(writer, reader):
    m = make_manifest("miss")
    fragments.publish_stage(writer, m, 0, *stage_payload(m, 0))  # stage 1 never publishes
    t0 = time.monotonic()
    with pytest.raises(DataIntegrityError, match=r"miss_layer3.*miss_layer4") as exc:
        fragments.fetch_sample(reader, m, retry_max_wait_s=1.0)
    took = time.monotonic() - t0
    print(f"\nmissing fragment: raised after {took:.2f}s (window 1.0s): {exc.value}")
    assert 1.0 <= took < 8
    reader.remove([f.key for f in m.all_objects])


@pytest.mark.timeout(60)
def test_late_fragment_within_the_window_is_read(writer, reader):
    m = make_manifest("late")
    fragments.publish_stage(writer, m, 0, *stage_payload(m, 0))
    timer = threading.Timer(0.5, lambda: fragments.publish_stage(writer, m, 1, *stage_payload(m, 1)))
    timer.start()
    sample = fragments.fetch_sample(reader, m, retry_max_wait_s=10)
    timer.join()
    assert_sample_matches(sample, m)
    assert reader.exists([f.key for f in m.all_objects]) == [False] * len(m.all_objects)


@pytest.mark.timeout(60)
def test_fragment_of_wrong_size_raises_naming_the_key(writer, reader):
    # A buggy stage that bypassed publish_stage's checks: one token short, or one token long.
    for name, cut in (("short", slice(None, -1)), ("long", None)):
        m = unsummed(make_manifest(name))  # the size check alone (a same-size change is the checksum's)
        fragments.publish_stage(writer, m, 0, *stage_payload(m, 0))
        layers, _ = stage_payload(m, 1)
        bad = layers[3][cut].contiguous() if cut else torch.cat([layers[3], layers[3][:1]])
        writer.put_many([(f"{name}_layer3", bad), (f"{name}_layer4", layers[4])])
        with pytest.raises(DataIntegrityError, match=f"{name}_layer3"):
            fragments.fetch_sample(reader, m, retry_max_wait_s=1.0)
        reader.remove([f.key for f in m.all_objects])


@pytest.mark.timeout(60)
def test_wrong_input_ids_raise_naming_the_key(writer, reader):
    m = unsummed(make_manifest("ids"))  # the ids checks alone (the checksum would refuse first)
    fragments.publish_stage(writer, m, 1, *stage_payload(m, 1))
    layers, _ = stage_payload(m, 0)
    # Another prompt's ids of the same length stand in for the real ones.
    other = tensor_for("other", (m.num_tokens,), torch.int64)
    writer.put_many([("ids_input_ids", other), ("ids_layer1", layers[1])])
    with pytest.raises(DataIntegrityError, match="ids_input_ids"):
        fragments.fetch_sample(reader, m, retry_max_wait_s=1.0)
    # Without a manifest digest the caller's expected ids catch it.
    m2 = unsummed(make_manifest("ids2", sha=False))
    publish_all(writer, m2)
    with pytest.raises(DataIntegrityError, match="ids2_input_ids"):
        fragments.fetch_sample(
            reader, m2, retry_max_wait_s=1.0, expected_input_ids=torch.zeros(m2.num_tokens, dtype=torch.int64)
        )
    reader.remove([f.key for f in (*m.all_objects, *m2.all_objects)])


@pytest.mark.timeout(60)
def test_one_corrupted_byte_in_the_real_store_is_refused_naming_the_key(writer, reader):
    """The master holds a fragment with one bit flipped, same size: the checksum its stage put
    beside it refuses the sample, naming the key, and the sample stays in the store."""
    m = make_manifest("flip")
    publish_all(writer, m)
    layers, _ = stage_payload(m, 1)
    bad = layers[3].clone()
    bad.view(torch.uint8).view(-1)[7] ^= 0x10
    writer.remove(["flip_layer3"])
    writer.put_many([("flip_layer3", bad)])
    with pytest.raises(
        DataIntegrityError, match=r"object 'flip_layer3': its bytes do not match.*'flip_sums1'"
    ):
        fragments.fetch_sample(reader, m, retry_max_wait_s=1.0)
    assert reader.exists([f.key for f in m.all_objects]) == [True] * len(m.all_objects)
    reader.remove([f.key for f in m.all_objects])


@pytest.mark.timeout(60)
def test_put_of_an_existing_key_raises_instead_of_keeping_stale_bytes(writer, reader):
    writer.put_many([("dup", torch.ones(8))])
    with pytest.raises(StoreError, match="dup"):
        writer.put_many([("dup", torch.zeros(8))])
    reader.remove(["dup"])


@pytest.mark.timeout(60)
def test_hard_pin_publish_and_fetch(master, reader):  # noqa: F811
    with MooncakeStore(master.address, small_store_cfg(enable_hard_pin=True), role="writer") as pinned:
        assert pinned._client() is not None and pinned._replicate.with_hard_pin is True
        m = make_manifest("pin")
        publish_all(pinned, m)
        assert_sample_matches(fragments.fetch_sample(reader, m, retry_max_wait_s=2), m)
        assert reader.exists([f.key for f in m.all_objects]) == [False] * len(m.all_objects)


@pytest.mark.timeout(60)
def test_read_removes_despite_the_lease(writer, reader):
    # A get takes a lease (kv_lease_ttl_s); removal right after must still succeed (force).
    m = make_manifest("lease")
    publish_all(writer, m)
    fragments.fetch_sample(reader, m, retry_max_wait_s=1)
    assert reader.exists([f.key for f in m.all_objects]) == [False] * len(m.all_objects)
    reader.remove([f.key for f in m.all_objects])  # already gone: still success


# -- faults ---------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_writer_process_killed_reader_fails_at_once_naming_the_key(master, reader, tmp_path):  # noqa: F811
    m = make_manifest("wdead")
    w = WriterProc(
        tmp_path, "publish", {"address": master.address, "stages": [0, 1], "manifests": [m.to_dict()]}
    )
    w.wait_for("published", 90)
    w.proc.kill()
    w.wait(10)
    t0 = time.monotonic()
    with pytest.raises(DataIntegrityError, match=r"wdead_.*TRANSFER_FAIL.*writer"):
        fragments.fetch_sample(reader, m, retry_max_wait_s=2)
    print(f"\nwriter killed: reader raised after {time.monotonic() - t0:.2f}s")
    assert time.monotonic() - t0 < 10
    # The master still lists the dead writer's objects until its client TTL runs out; drop them.
    reader.remove([f.key for f in m.all_objects])
    assert reader.exists([f.key for f in m.all_objects]) == [False] * len(m.all_objects)


@pytest.mark.timeout(120)
def test_master_killed_mid_run_writer_raises_reader_fails_after_window(tmp_path):
    own = launch_master(small_store_cfg(), tmp_path / "master")
    done = make_manifest("before")
    late = make_manifest("after")
    writer = WriterProc(
        tmp_path / "writer",
        "publish-after-kill",
        {
            "address": own.address,
            "stages": [0, 1],
            "manifests": [done.to_dict()],
            "late_manifest": late.to_dict(),
        },
    )
    reader = MooncakeStore(own.address, small_store_cfg(), role="reader")
    try:
        writer.wait_for("published", 90)
        assert_sample_matches(fragments.fetch_sample(reader, done, retry_max_wait_s=5), done)
        own.kill()
        killed_at = time.monotonic()
        writer.signal("killed")
        report = writer.wait_for("late", 60)
        window = 2.0
        t0 = time.monotonic()
        with pytest.raises(StoreError) as exc:
            fragments.fetch_sample(reader, late, retry_max_wait_s=window)
        reader_s = time.monotonic() - t0
        print(
            f"\nmaster killed: writer raised {report.get('type')} after {report['seconds']:.3f}s "
            f"({report.get('error')}); reader raised {type(exc.value).__name__} after {reader_s:.2f}s "
            f"(window {window}s); since kill {time.monotonic() - killed_at:.2f}s"
        )
        assert report["raised"] and "Mooncake master" in report["error"]
        assert isinstance(exc.value, StoreUnavailableError)
        assert window <= reader_s < window + 15
        assert writer.wait(30) == 0
    finally:
        t0 = time.monotonic()
        reader.close(timeout_s=2)
        assert time.monotonic() - t0 < 5  # close is bounded even with the master gone
        own.stop()


@pytest.mark.timeout(60)
def test_writer_keeps_its_fragments_in_its_own_segment(master, writer, reader):  # noqa: F811
    # With a second writer's segment available, default placement would scatter the objects.
    with MooncakeStore(master.address, small_store_cfg(), role="writer") as other:
        other.put_many([("other_probe", torch.zeros(4))])
        keys = [f"own{i}" for i in range(16)]
        writer.put_many([(k, torch.full((256,), float(i))) for i, k in enumerate(keys)])
        client = writer._client()
        segments = {
            client.get_replica_desc(k)[0].get_memory_descriptor().buffer_descriptor.transport_endpoint
            for k in keys
        }
        assert len(segments) == 1, segments
        reader.remove([*keys, "other_probe"])
