"""`rundir.atomic`: a write is whole or absent, never partial, and leaves no temporary file; and
`rundir.layout` spells the trainer's and the spool's file names the runs and resumes rely on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctoolkit.errors import ConfigError
from hpctoolkit.rundir.atomic import (
    atomic_path,
    read_json,
    read_json_object,
    write_bytes_atomic,
    write_json_atomic,
    write_text_atomic,
)
from hpctoolkit.rundir.layout import RunDir, SpoolDir, TrainDir


def test_writes_create_parents_and_leave_no_temporary(tmp_path):
    target = tmp_path / "a" / "b" / "rec.json"
    assert write_json_atomic(target, {"x": Path("/p"), "y": 1}) == target
    assert target.read_text() == '{"x": "/p", "y": 1}\n'  # one line, `default=str`
    write_text_atomic(target, "t")
    assert target.read_text() == "t"
    write_bytes_atomic(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    write_json_atomic(target, {"b": 1, "a": 2}, indent=2, sort_keys=True)
    assert json.loads(target.read_text()) == {"a": 2, "b": 1} and target.read_text().startswith('{\n  "a"')
    assert sorted(p.name for p in target.parent.iterdir()) == ["rec.json"]


def _write_half_then_fail(target: Path, data: bytes) -> None:
    with atomic_path(target) as tmp:
        tmp.write_bytes(data[: len(data) // 2])
        raise RuntimeError("midway")


def test_a_failure_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "shard.bin"
    with pytest.raises(RuntimeError, match="midway"):
        _write_half_then_fail(target, b"whole shard")
    assert list(tmp_path.iterdir()) == []  # neither a partial file nor a temporary one
    write_bytes_atomic(target, b"old")
    with pytest.raises(RuntimeError, match="midway"):
        _write_half_then_fail(target, b"new shard")
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["shard.bin"]


def test_a_json_record_that_cannot_be_encoded_leaves_nothing(tmp_path):
    target = tmp_path / "rec.json"
    cyclic: list = []
    cyclic.append(cyclic)
    with pytest.raises(ValueError, match="Circular"):
        write_json_atomic(target, cyclic)
    assert list(tmp_path.iterdir()) == [] and read_json(target) is None


def test_a_writer_that_never_creates_the_temporary_fails_without_touching_the_target(tmp_path):
    target = tmp_path / "model.safetensors"
    target.write_bytes(b"kept")
    with pytest.raises(FileNotFoundError), atomic_path(target):
        pass
    assert target.read_bytes() == b"kept"


def test_train_and_spool_layout_names_are_stable(tmp_path):
    run = RunDir.of(tmp_path, "r-j1")
    files = run.train_files
    assert files == TrainDir(tmp_path / "r-j1" / "train")
    rel = {
        k: str(getattr(files, k).relative_to(files.root))
        for k in ("checkpoints", "tensorboard", "data_order", "draft", "export", "draft_vocab", "summary")
    }
    assert rel == {
        "checkpoints": "checkpoints",
        "tensorboard": "tensorboard",
        "data_order": "data_order",
        "draft": "draft",
        "export": "export",
        "draft_vocab": "draft_vocab.json",
        "summary": "train_summary.json",
    }
    assert files.order_log(3) == files.root / "data_order" / "rank3.jsonl"
    assert files.acceptance_plot.name == "acceptance_per_position.png"
    assert run.checkpoints == files.checkpoints and run.export == files.export
    assert run.spool_files == SpoolDir(run.root / "spool")
    assert run.spool_files.shards(2) == run.spool / "rank2"
    assert run.spool_files.read_record(2) == run.spool / "read-rank2.json"


def test_begin_attempt_moves_each_queue_whole_onto_its_stale_list(tmp_path):
    from hpctoolkit.rundir.ledger import begin_attempt

    run = RunDir.of(tmp_path, "r-j1").create()
    run.manifests.mkdir()
    run.stale_queue(0).write_text('{"a": 0}\n')
    run.queue(0).write_text('{"a": 1}\n{"a": 2}\n')
    assert begin_attempt(run, "1", 1)
    assert run.stale_queue(0).read_text().splitlines() == ['{"a": 0}', '{"a": 1}', '{"a": 2}']
    assert sorted(p.name for p in run.manifests.iterdir()) == ["engine0.stale.jsonl"]


def test_begin_attempt_removes_an_earlier_attempts_port_records(tmp_path):
    """A requeued job's peers must wait for this attempt's listeners, not dial the last one's."""
    from hpctoolkit.rundir.ledger import begin_attempt

    run = RunDir.of(tmp_path, "r-j1").create()
    run.ports.mkdir()
    run.port_record("trainers").write_text('{"port": 40123}')
    assert run.port_record("engine0-generate") == run.root / "ports" / "engine0-generate.json"
    assert begin_attempt(run, "1", 1)
    assert not run.port_record("trainers").exists()


def test_read_json_object_fails_in_one_line_naming_the_file(tmp_path):
    good = tmp_path / "good.json"
    good.write_text('{"a": 1}')
    assert read_json_object(good, "draft.config") == {"a": 1}
    cases = {
        "nope.json": None,
        "broken.json": "{",
        "list.json": "[1]",
    }
    wants = {
        "nope.json": "does not exist",
        "broken.json": "is not valid JSON",
        "list.json": "must hold a JSON object",
    }
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as info:
            read_json_object(tmp_path / name, "draft.config")
        msg = str(info.value)
        assert msg.startswith(f"draft.config: {tmp_path / name} {wants[name]}") and "\n" not in msg, msg
