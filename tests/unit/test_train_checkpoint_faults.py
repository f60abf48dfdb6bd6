"""Checkpoints survive crashes and damage (`train.checkpoint`): a crash mid-write leaves the
previous checkpoint the newest; a truncated or corrupted newest one, or one holding a pickled
object, is set aside and the previous one loaded, in one warning line naming both; anything in
`checkpoints/` that is not a complete `step-<digits>` directory is ignored. One in-process rank."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.train import checkpoint
from hpctoolkit.train.checkpoint import Checkpointer
from hpctoolkit.train.fsdp import DistContext

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # one rank, no process group
]


class _Smuggled:
    """Not a weight: `torch.load(weights_only=True)` must refuse to build it."""


def _parts(tmp_path):
    ctx = DistContext(rank=0, world_size=1, device=torch.device("cpu"), owns_group=False)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return Checkpointer(tmp_path, keep=3, ctx=ctx), model, optimizer, scheduler


def _train_and_save(ck, model, optimizer, scheduler, step):
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    ck.save(step, model, optimizer, scheduler, samples_consumed={"epoch": 0, "offset": step}, meta={})
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def two(tmp_path, monkeypatch):
    """Checkpoints at steps 1 and 2, the weights of each, and the lines the trainer said."""
    said: list[str] = []
    monkeypatch.setattr(checkpoint, "say", said.append)
    ck, model, opt, sched = _parts(tmp_path)
    w1 = _train_and_save(ck, model, opt, sched, 1)
    w2 = _train_and_save(ck, model, opt, sched, 2)
    return ck, (model, opt, sched), w1, w2, said


def _resume(ck, parts):
    model = parts[0]
    with torch.no_grad():
        model.weight.zero_()
    return ck.load_newest(*parts)


def test_meta_lists_every_file_with_its_checksum(two):
    ck, _, _, _, _ = two
    meta = json.loads((ck.latest() / "meta.json").read_text())
    names = set(meta["files"])
    assert {"rank-0.pt", "ledger-rank0.json", ".metadata"} <= names
    assert all(v["digest"].startswith("xxh3_64:") for v in meta["files"].values())
    assert not list(ck.latest().glob(".sums-*"))


def test_an_intact_newest_checkpoint_loads(two):
    ck, parts, _, w2, said = two
    meta = _resume(ck, parts)
    assert meta["step"] == 2 and said == []
    torch.testing.assert_close(parts[0].state_dict(), w2)


def _shard(path):
    return next(p for p in path.iterdir() if p.suffix == ".distcp")


@pytest.mark.parametrize("damage", ["truncate_shard", "flip_shard_byte", "truncate_rank_file", "bad_meta"])
def test_a_damaged_newest_checkpoint_falls_back_and_says_so(two, damage):
    ck, parts, w1, _, said = two
    newest = ck.latest()
    if damage == "truncate_shard":
        shard = _shard(newest)
        shard.write_bytes(shard.read_bytes()[:-7])
    elif damage == "flip_shard_byte":
        shard = _shard(newest)
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x40
        shard.write_bytes(bytes(data))
    elif damage == "truncate_rank_file":
        f = newest / "rank-0.pt"
        f.write_bytes(f.read_bytes()[:10])
    else:
        (newest / "meta.json").write_text('{"step": 2, "world')
    meta = _resume(ck, parts)
    assert meta["step"] == 1
    torch.testing.assert_close(parts[0].state_dict(), w1)
    assert len(said) == 1
    assert "step-00000002" in said[0] and "step-00000001" in said[0] and "unreadable" in said[0]
    # Kept for the user, never picked again.
    assert (newest.parent / "step-00000002.unreadable").is_dir()
    assert ck.latest().name == "step-00000001"


def test_no_readable_checkpoint_fails_instead_of_starting_over(two):
    ck, parts, _, _, _ = two
    for path in ck.complete():
        (path / "rank-0.pt").write_bytes(b"\0" * 5)
    with pytest.raises(DataIntegrityError, match="step-00000001 is unreadable"):
        _resume(ck, parts)


def test_a_live_resume_refuses_to_fall_back(two):
    ck, parts, _, _, _ = two
    (ck.latest() / "rank-0.pt").write_bytes(b"\0" * 5)
    with pytest.raises(DataIntegrityError, match=r"step-00000002 is unreadable.*capture only"):
        ck.load_newest(*parts, fallback=False)


def test_a_pickled_object_is_refused(two):
    ck, parts, _, _, said = two
    newest = ck.latest()
    extra = torch.load(newest / "rank-0.pt", weights_only=True)
    torch.save({**extra, "scheduler": _Smuggled()}, newest / "rank-0.pt")
    # Its sums updated, so only `weights_only` stands between the object and the trainer.
    meta = json.loads((newest / "meta.json").read_text())
    meta["files"]["rank-0.pt"] = checkpoint.checksum.files_record([newest / "rank-0.pt"], newest)["rank-0.pt"]
    (newest / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(pickle.UnpicklingError):
        ck.load(newest, *parts)
    assert _resume(ck, parts)["step"] == 1 and "UnpicklingError" in said[0]


def test_a_crash_mid_write_leaves_the_previous_checkpoint_newest(two):
    ck, parts, _, w2, said = two
    root = ck.root
    # Step 3 died mid-save: its files under the temporary names, nothing renamed into place.
    partial = root / "step-00000003.partial"
    partial.mkdir()
    (partial / ".rank-0.pt.tmp-123-456").write_bytes(b"half a file")
    (partial / "__0_0.distcp").write_bytes(b"x" * 10)
    # A crash between the directory's rename and its meta.json: not complete either.
    (root / "step-00000004").mkdir()
    (root / "step-00000004" / ".meta.json.tmp-1-2").write_text("{")
    assert ck.latest().name == "step-00000002"
    assert _resume(ck, parts)["step"] == 2 and said == []
    torch.testing.assert_close(parts[0].state_dict(), w2)


def test_stray_directories_are_ignored(two):
    ck, parts, _, _, said = two
    for name in ("step-final", "step-00000009-copy", "notes", "step-00000002.bak"):
        (ck.root / name).mkdir()
        (ck.root / name / "meta.json").write_text(json.dumps({"step": 9, "world_size": 1}))
    (ck.root / "step-00000007").write_text("a file, not a directory")
    assert [p.name for p in ck.complete()] == ["step-00000001", "step-00000002"]
    assert _resume(ck, parts)["step"] == 2 and said == []
