"""`run.train` end to end: offline shards in, checkpoints, tensorboard, plot, export and summary out."""

import json
from pathlib import Path

import pytest
import torch

from hpctoolkit.capture.manifest import build_manifest
from hpctoolkit.data.offline import ShardWriter
from hpctoolkit.data.sample import Sample
from hpctoolkit.recipe.schema import RecipeConfig
from hpctoolkit.targets.resolve import resolve_target
from hpctoolkit.train.hf_capture import recapture
from hpctoolkit.train.run import train
from hpctoolkit.train.synthetic import SyntheticSamples

pytestmark = pytest.mark.timeout(180)
NUM_LAYERS = 6


def _recipe(draft: str, out: Path, **training) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.paths.target_model = "builtin:tiny-qwen3"
    cfg.paths.output_dir = str(out)
    cfg.draft.config = f"recipes/draft_models/{draft}.json"
    t = cfg.training
    t.steps, t.batch_size, t.warmup_steps, t.checkpoint_every = 4, 2, 1, 2
    t.num_anchors, t.ttt_length, t.max_seq_len, t.lr = 4, 3, 64, 1e-3
    for k, v in training.items():
        setattr(t, k, v)
    return cfg


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Six samples of the tiny target, captured with transformers, written as offline shards."""
    out = tmp_path_factory.mktemp("shards")
    target = resolve_target("builtin:tiny-qwen3")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (20, 24, 31, 17, 40, 22)]
    aux_ids = [2, 3, 4]  # tiny_dflash reads target layers 1, 2, 3
    with ShardWriter(out) as w:
        for i, (seq, (aux, last)) in enumerate(zip(seqs, recapture(target, seqs, aux_ids), strict=True)):
            m = build_manifest(
                f"s{i}",
                [*aux_ids, NUM_LAYERS],
                len(seq),
                128,
                NUM_LAYERS,
                1,
                "bfloat16",
                extra={"last_hidden_states_prenorm": True},
            )
            s = Sample.empty_for(m)
            s.input_ids.copy_(torch.tensor(seq))
            s.aux_hidden_states.copy_(aux.to(torch.bfloat16))
            s.last_hidden_states.copy_(last.to(torch.bfloat16))
            w.add(s)
    return out


def test_train_from_offline_shards_writes_everything(shards, tmp_path):
    summary = train(_recipe("tiny_dflash", tmp_path), str(shards), tmp_path)
    assert summary["steps_trained"] == 4 and summary["stop_reason"] == "completed"
    assert summary["final_loss"] > 0 and summary["acceptance_length"] >= 1.0
    m = summary["train_metrics"]
    assert len(m["per_position_accuracy"]) == 3  # block_size 4 -> 3 drafted slots
    # The trainer's figure is named at its depth, and given at every shallower k too.
    assert summary["acceptance_depth"] == 3 and list(summary["acceptance_length_by_k"]) == ["1", "2", "3"]
    assert summary["acceptance_length_by_k"]["3"] == summary["acceptance_length"]
    assert "own depth" in summary["acceptance_convention"]
    assert m["acceptance_length_incl_bonus"] == pytest.approx(1 + m["simulated_acc_len_excl_bonus"])
    assert (tmp_path / "export" / "model.safetensors").is_file()
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == [
        "DFlashDraftModel"
    ]
    assert (tmp_path / "acceptance_per_position.png").stat().st_size > 0
    assert any((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]
    assert json.loads((tmp_path / "train_summary.json").read_text())["steps_trained"] == 4


def test_two_spawned_ranks_share_the_shards(shards, tmp_path):
    summary = train(_recipe("tiny_dflash", tmp_path, world_size=2, steps=2), str(shards), tmp_path)
    assert summary["world_size"] == 2 and summary["steps_trained"] == 2
    orders = [
        [json.loads(x)["keys"] for x in (tmp_path / "data_order" / f"rank{r}.jsonl").read_text().splitlines()]
        for r in (0, 1)
    ]
    # Epoch 0 in stored order, split i % 2; epoch 1 is a seeded permutation, still disjoint.
    assert [orders[0][0], orders[0][1][0]] == [["s0", "s2"], "s4"]
    assert [orders[1][0], orders[1][1][0]] == [["s1", "s3"], "s5"]
    assert orders[0][1][1] != orders[1][1][1]


@pytest.mark.parametrize("draft", ["tiny_eagle3", "tiny_dspark", "tiny_k3_dspark_mla"])
def test_each_family_trains_and_exports(tmp_path, draft):
    src = SyntheticSamples(num_samples=8, vocab_size=512, hidden_size=128, num_aux=3, seed=2)
    summary = train(_recipe(draft, tmp_path, steps=2, checkpoint_every=2), src, tmp_path)
    assert summary["steps_trained"] == 2
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    if draft == "tiny_eagle3":
        from safetensors.torch import load_file

        d2t = load_file(str(tmp_path / "export" / "model.safetensors"))["d2t"]
        assert d2t.numel() == 256  # the pruned vocabulary travels with the export
        assert summary["train_metrics"]["per_position_accuracy"].__len__() == 3  # ttt_length
    else:
        assert "loss_l1" in summary["train_metrics"] and "loss_bce" in summary["train_metrics"]
    assert exported["architectures"]


def test_a_live_source_that_runs_dry_stops_every_rank_cleanly(tmp_path):
    src = SyntheticSamples(num_samples=3, vocab_size=512, hidden_size=128, num_aux=3, seed=2)

    def once(rank, world, epoch, skip):  # a live store is read once: nothing after epoch 0
        return src(rank, world, epoch, skip) if epoch == 0 else iter(())

    summary = train(_recipe("tiny_dflash", tmp_path, steps=5), once, tmp_path)
    assert summary["steps_trained"] == 1
    assert summary["stop_reason"].startswith("samples source exhausted")
    assert (tmp_path / "export" / "model.safetensors").is_file()


def test_bf16_mixed_precision_trains(tmp_path):
    src = SyntheticSamples(num_samples=4, vocab_size=512, hidden_size=128, num_aux=3, seed=4)
    summary = train(_recipe("tiny_dspark", tmp_path, steps=2, mixed_precision="bf16"), src, tmp_path)
    assert summary["steps_trained"] == 2 and summary["final_loss"] > 0
    # master weights stay fp32; the export is bf16, as vLLM serves it
    from safetensors.torch import load_file

    assert {t.dtype for t in load_file(str(tmp_path / "draft" / "model.safetensors")).values()} <= {
        torch.float32,
        torch.int64,
        torch.bool,
    }


def test_options_without_effect_are_named(caplog):
    from hpctoolkit.models.registry import load_draft_config
    from hpctoolkit.train.build import warn_unused_options
    from hpctoolkit.train.config import TrainingConfig

    eagle = load_draft_config("recipes/draft_models/tiny_eagle3.json")
    assert warn_unused_options(eagle, TrainingConfig(num_anchors=3, label_source="data")) == [
        "num_anchors",
        "label_source",
    ]
    dflash = load_draft_config("recipes/draft_models/tiny_dflash.json")
    assert warn_unused_options(dflash, TrainingConfig(ttt_length=2)) == ["ttt_length"]
    assert "no effect" in caplog.text


def test_train_and_evaluate_import_without_vllm_or_mooncake():
    import subprocess
    import sys

    code = (
        "import sys, hpctoolkit.train.run, hpctoolkit.evaluate, hpctoolkit.models.registry;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'mooncake')];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_live_source_follows_the_manifest_file_and_drains_the_store(tmp_path):
    from hpctoolkit.store import fragments
    from hpctoolkit.store.memory import MemoryStore
    from hpctoolkit.train.source import LiveSource

    store = MemoryStore()
    lines = []
    g = torch.Generator().manual_seed(0)
    for i in range(4):
        m = build_manifest(f"live{i}", [2, 3, 4, NUM_LAYERS], 20 + i, 128, NUM_LAYERS, 1, "bfloat16")
        layers = {f.layer_id: torch.randn(20 + i, 128, generator=g).to(torch.bfloat16) for f in m.fragments}
        fragments.publish_stage(store, m, 0, layers, torch.randint(0, 500, (20 + i,), generator=g))
        lines.append(m.to_json())
    (tmp_path / "manifests.jsonl").write_text("\n".join(lines) + "\n")
    src = LiveSource(
        str(tmp_path / "manifests.jsonl"), expected=4, store_factory=lambda: store, retry_max_wait_s=1
    )
    summary = train(_recipe("tiny_dflash", tmp_path, steps=3), src, tmp_path)
    assert summary["steps_trained"] == 2 and summary["stop_reason"].startswith("samples source exhausted")
    assert store.keys() == []  # every sample fetched once and removed


def test_an_unservable_draft_is_kept_and_the_refusal_reported(tmp_path):
    import json as _json

    cfg_path = tmp_path / "k3_fc_norm.json"
    data = _json.loads(Path("recipes/draft_models/tiny_k3_dspark_mla.json").read_text())
    cfg_path.write_text(_json.dumps({**data, "fc_norm": True}))  # vLLM 0.32 has no fc_norm
    src = SyntheticSamples(num_samples=4, vocab_size=512, hidden_size=128, num_aux=3, seed=2)
    recipe = _recipe("tiny_k3_dspark_mla", tmp_path, steps=1)
    recipe.draft.config = str(cfg_path)
    summary = train(recipe, src, tmp_path)
    assert "fc_norm" in summary["export_error"] and "export_dir" not in summary
    assert (tmp_path / "draft" / "model.safetensors").is_file()


def test_activation_checkpointing_is_a_validated_training_option():
    from hpctoolkit.errors import ConfigError
    from hpctoolkit.train.config import TrainingConfig

    TrainingConfig(activation_checkpoint_layers=2).validate()
    with pytest.raises(ConfigError, match="activation_checkpoint_layers must be >= 0"):
        TrainingConfig(activation_checkpoint_layers=-1).validate()
    with pytest.raises(ConfigError, match="compile must be one of"):
        TrainingConfig(compile="yes").validate()


def _step_grads(ctx, cfg, batch):
    """Loss and full gradients of one sharded DSpark step (tiny MLA draft, fp32, CPU)."""
    from hpctoolkit.train.build import build_trainer
    from hpctoolkit.train.fsdp import build_mesh, shard_trainer
    from hpctoolkit.train.step import forward_backward

    tr = build_trainer(
        "recipes/draft_models/tiny_k3_dspark_mla.json", resolve_target("builtin:tiny-qwen3"), cfg
    )
    shard_trainer(tr, build_mesh(ctx, cfg.fsdp_mode), cfg)
    parts = forward_backward(tr, batch, 0, ctx)
    # One rank trains without FSDP (plain gradients); `full_tensor` where a DTensor comes back.
    grads = {
        n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)()
        for n, p in tr.named_parameters()
        if p.grad is not None
    }
    return float(parts.numerator.detach()) / float(parts.denominator), grads, tr


def test_activation_checkpointing_gives_the_same_step(tmp_path):
    """Recomputing decoder layers in backward changes memory, not the step: same loss, same grads
    (CPU, fp32, to 1e-6 relative); asking for more layers than the draft has is refused."""
    from hpctoolkit.errors import ConfigError
    from hpctoolkit.train.batch import collate
    from hpctoolkit.train.config import TrainingConfig
    from hpctoolkit.train.fsdp import init_distributed

    src = SyntheticSamples(
        num_samples=2, vocab_size=512, hidden_size=128, num_aux=3, lengths=[40, 33], seed=6
    )
    batch = collate([src.sample(i) for i in range(2)], max_seq_len=64, min_loss_tokens=14)
    ctx = init_distributed(0, 1, f"file://{tmp_path / 'rdzv'}", "cpu")
    try:
        ref_loss, ref, _ = _step_grads(ctx, TrainingConfig(num_anchors=4), batch)
        loss, got, tr = _step_grads(ctx, TrainingConfig(num_anchors=4, activation_checkpoint_layers=2), batch)
        assert tr.draft.checkpoint_layers == 2
        assert loss == pytest.approx(ref_loss, rel=1e-6)
        assert got.keys() == ref.keys() and any(".layers.1." in n for n in ref)
        for name, g in ref.items():
            torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-8, msg=name)
        with pytest.raises(ConfigError, match="activation_checkpoint_layers=9"):
            _step_grads(ctx, TrainingConfig(num_anchors=4, activation_checkpoint_layers=9), batch)
    finally:
        ctx.close()


def test_one_ahead_reads_a_step_only_once_the_next_is_queued():
    """`step.one_ahead`: step n is handed back after step n + 1 is launched, the last at the end,
    each exactly once and in order."""
    from hpctoolkit.train.step import one_ahead

    events: list[str] = []

    def launches():
        for n in range(4):
            events.append(f"launch {n}")
            yield n

    for n in one_ahead(launches()):
        events.append(f"read {n}")
    assert events == ["launch 0", "launch 1", "read 0", "launch 2", "read 1", "launch 3", "read 2", "read 3"]
    assert list(one_ahead(iter(()))) == []
