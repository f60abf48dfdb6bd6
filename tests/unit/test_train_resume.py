"""Checkpoint, stop, resume: the step counter continues and the next batch is the one that would have come.

Two runs of the same 4-step job on synthetic samples (fp32, one in-process rank): one straight
through, one interrupted after step 2 (its step-2 checkpoint) and resumed. They must read the
same samples at every step and end with the same parameters (atol 1e-6) and loss (rel 1e-5).
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpctoolkit.targets.resolve import resolve_target
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.loop import TrainJob
from hpctoolkit.train.run import launch
from hpctoolkit.train.synthetic import SyntheticSamples

pytestmark = pytest.mark.timeout(180)


def _job(out: Path, *, stop_after: int | None = None, keep: int = 2) -> TrainJob:
    cfg = TrainingConfig(
        steps=4,
        batch_size=2,
        warmup_steps=1,
        checkpoint_every=2,
        keep_checkpoints=keep,
        num_anchors=4,
        max_seq_len=64,
        lr=1e-3,
        seed=3,
    )
    # 5 samples: the epoch boundary (step 3 reads sample 4 and then wraps) is inside the run.
    src = SyntheticSamples(num_samples=5, vocab_size=512, hidden_size=128, num_aux=3, seed=7)
    return TrainJob(
        "recipes/draft_models/tiny_dflash.json",
        str(resolve_target("builtin:tiny-qwen3")),
        cfg,
        src,
        str(out),
        show_progress=False,
        stop_after=stop_after,
    )


def _order(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "data_order" / "rank0.jsonl").read_text().splitlines()]


def test_resume_continues_step_and_data_order(tmp_path):
    straight = launch(_job(tmp_path / "a"), 1)
    first = launch(_job(tmp_path / "b", stop_after=2), 1)
    assert first["steps_trained"] == 2 and first["stop_reason"] == "stop_after"
    assert (tmp_path / "b" / "checkpoints" / "step-00000002" / "meta.json").is_file()
    resumed = launch(_job(tmp_path / "b"), 1)

    assert resumed["resumed_from_step"] == 2
    assert resumed["steps_this_run"] == 2 and resumed["steps_trained"] == 4
    assert _order(tmp_path / "b") == _order(tmp_path / "a")
    assert [r["keys"] for r in _order(tmp_path / "a")] == [
        ["syn-0", "syn-1"],
        ["syn-2", "syn-3"],
        ["syn-4", "syn-0"],
        ["syn-1", "syn-2"],
    ]
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-5)
    a = load_file(str(tmp_path / "a" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "draft" / "model.safetensors"))
    for name, t in a.items():
        torch.testing.assert_close(b[name], t, rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_rotation_keeps_the_newest(tmp_path):
    launch(_job(tmp_path, keep=1), 1)
    dirs = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert dirs == ["step-00000004"]


def test_resume_with_another_world_size_is_refused(tmp_path):
    from hpctoolkit.errors import ConfigError

    launch(_job(tmp_path, stop_after=2), 1)
    meta = tmp_path / "checkpoints" / "step-00000002" / "meta.json"
    data = json.loads(meta.read_text())
    meta.write_text(json.dumps({**data, "world_size": 2}))
    with pytest.raises(ConfigError, match="written by 2 ranks"):
        launch(_job(tmp_path), 1)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one rank, no process group
def test_checkpointer_round_trips_the_stream_position(tmp_path):
    # `samples_consumed` is the stream's position (epoch and offset), not a count.
    from hpctoolkit.train.checkpoint import Checkpointer
    from hpctoolkit.train.fsdp import DistContext
    from hpctoolkit.train.source import SampleStream

    ctx = DistContext(rank=0, world_size=1, device=torch.device("cpu"), owns_group=False)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    stream = SampleStream(lambda *a: iter(()), 0, 1, epoch=3, offset=7)
    ckpt = Checkpointer(tmp_path, keep=1, ctx=ctx)
    path = ckpt.save(5, model, optimizer, scheduler, samples_consumed=stream.position, meta={"family": "x"})
    assert ckpt.latest() == path
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.zero_()
    meta = ckpt.load(path, model, optimizer, scheduler)
    assert meta["step"] == 5 and meta["family"] == "x"
    assert meta["samples_consumed"] == {"epoch": 3, "offset": 7}
    assert SampleStream(lambda *a: iter(()), 0, 1, **meta["samples_consumed"]).position == stream.position
    torch.testing.assert_close(model.state_dict(), want)


def test_resuming_a_finished_run_keeps_its_figures_then_a_damaged_newest_falls_back(tmp_path, capsys):
    done = launch(_job(tmp_path), 1)
    assert done["steps_this_run"] == 4 and done["final_loss"] is not None
    again = launch(_job(tmp_path), 1)  # by hand, after the end: nothing to train
    assert again["steps_this_run"] == 0 and again["resumed_from_step"] == 4
    assert again["final_loss"] == done["final_loss"]
    assert again["acceptance_length"] == done["acceptance_length"]
    # Step 4's weights damaged on disk: step 2 is loaded instead, and the trainer says so.
    shard = next((tmp_path / "checkpoints" / "step-00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-3])
    redone = launch(_job(tmp_path), 1)
    assert redone["resumed_from_step"] == 2 and redone["steps_this_run"] == 2
    assert redone["final_loss"] == pytest.approx(done["final_loss"], rel=1e-5)
    line = next(x for x in capsys.readouterr().out.splitlines() if "unreadable" in x)
    assert "step-00000004" in line and "step-00000002" in line


def test_two_ranks_agree_to_fall_back_when_one_finds_its_file_damaged(tmp_path):
    """Each rank checks a slice of the files; rank 0 alone may not see the damage, yet both ranks
    load the same earlier checkpoint (a collective decision, or they would deadlock)."""
    launch(_job(tmp_path), 2)
    newest = tmp_path / "checkpoints" / "step-00000004"
    meta = json.loads((newest / "meta.json").read_text())
    odd = sorted(meta["files"])[1]  # in rank 1's slice
    data = bytearray((newest / odd).read_bytes())
    data[len(data) // 2] ^= 0x01
    (newest / odd).write_bytes(bytes(data))
    again = launch(_job(tmp_path), 2)
    assert again["resumed_from_step"] == 2 and again["steps_this_run"] == 2
    assert (tmp_path / "checkpoints" / "step-00000004.unreadable").is_dir()
