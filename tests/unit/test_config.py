"""Bad input gets one line naming the key and exit code 2; good input validates and plans."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpctoolkit.cli import run_cli
from hpctoolkit.errors import ConfigError
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.submit import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def draft_json(tmp_path):
    def make(**over):
        d = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "block_size": 7,
            "target_hidden_size": 128,
            "dflash_config": {"mask_token_id": 4, "target_layer_ids": [0, 2, 4]},
        }
        d.update(over)
        p = tmp_path / f"draft{len(list(tmp_path.glob('draft*')))}.json"
        p.write_text(json.dumps(d))
        return str(p)

    return make


@pytest.fixture
def recipe(tmp_path, draft_json):
    def make(body: dict | str | None = None, **sections):
        base = {
            "paths": {"output_dir": str(tmp_path / "out"), "target_model": "builtin:tiny-qwen3"},
            "draft": {"config": draft_json()},
            "engine": {"target_layer_ids": [0, 2, 4]},
        }
        for k, v in sections.items():
            base.setdefault(k, {}).update(v)
        p = tmp_path / "recipe.yaml"
        p.write_text(body if isinstance(body, str) else yaml.safe_dump(base))
        return str(p)

    return make


def _fail(capsys, argv):
    with pytest.raises(SystemExit) as info:
        run_cli(main, [*argv, "--dry-run"])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_valid_recipe_dry_run(capsys, recipe):
    with pytest.raises(SystemExit) as info:
        run_cli(main, [recipe(), "--dry-run"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert "capture ids [1, 3, 5, 6]" in out
    assert "nothing was started" in out


def test_missing_required_value(capsys, recipe, tmp_path):
    p = recipe()
    d = yaml.safe_load(Path(p).read_text())
    d["paths"]["output_dir"] = "???"
    Path(p).write_text(yaml.safe_dump(d))
    assert "paths.output_dir is required" in _fail(capsys, [p])


def test_unknown_key_lists_valid_keys(capsys, recipe):
    line = _fail(capsys, [recipe(store={"lease_ttl": 3})])
    assert "unknown key store.lease_ttl" in line
    assert "kv_lease_ttl_s" in line
    assert "master_address" in line


def test_unknown_section(capsys, recipe):
    assert "unknown key stor" in _fail(capsys, [recipe(stor={"x": 1})])


def test_unknown_override_key(capsys, recipe):
    line = _fail(capsys, [recipe(), "training.stepz=3"])
    assert "unknown key training.stepz" in line
    assert "steps" in line


def test_wrong_type(capsys, recipe):
    assert "store.kv_lease_ttl_s has the wrong type" in _fail(capsys, [recipe(), "store.kv_lease_ttl_s=soon"])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("store.kv_lease_ttl_s=-1", "store.kv_lease_ttl_s must be > 0"),
        ("training.steps=0", "training.steps must be > 0"),
        ("store.master_port=70000", "store.master_port must be <= 65535"),
        ("training.fsdp_mode=zero3", "training.fsdp_mode must be one of"),
        ("training.optimizer=lamb", "training.optimizer must be one of"),
        ("training.optimizer=mixed_adamw", "training.optimizer mixed_adamw runs on CUDA only"),
        ("store.global_segment_size=lots", "store.global_segment_size must be a size"),
        ("store.master_address=nohost", "store.master_address must be host:port"),
        ("store.backpressure_high=1.5", "store.backpressure_high must lie in (backpressure_low=0.5, 1)"),
        ("store.backpressure_max_pause_s=0", "store.backpressure_max_pause_s must be > 0"),
        ("training.epochs=-1", "training.epochs must be >= 0"),
        ("training.spool_max_size=big", "training.spool_max_size must be a size"),
        ("cluster.trainer_placement=anywhere", "cluster.trainer_placement must be one of"),
        ("cluster.host_memory_per_worker=lots", "cluster.host_memory_per_worker must be a size"),
        # Plan sizing (the couplings): Mooncake's smallest segment, the counts relation.
        ("store.global_segment_size=1MB", "below Mooncake's smallest segment"),
        ("data.num_samples=100000", "never read (captured for nothing)"),
        ("training.epochs=1", "set training.epochs="),
        # The longest sample (max_prompt_tokens 512 + regenerate_tokens) against the engine and trainer.
        (
            "data.regenerate_tokens=1536",
            "= 2048 tokens, a sample the engine cannot capture: engine.max_model_len=2048",
        ),
        ("training.max_seq_len=500", "training.max_seq_len=500 would cut such a sample"),
    ],
)
def test_out_of_range(capsys, recipe, override, needle):
    assert needle in _fail(capsys, [recipe(), override])


def test_malformed_yaml(capsys, recipe):
    line = _fail(capsys, [recipe("paths: [unclosed\n")])
    assert "is not valid YAML" in line
    assert "line" in line


def test_recipe_does_not_exist(capsys, tmp_path):
    assert f"recipe {tmp_path}/nope.yaml does not exist" in _fail(capsys, [str(tmp_path / "nope.yaml")])


def test_bad_override_syntax(capsys, recipe):
    assert "must look like section.key=value" in _fail(capsys, [recipe(), "training.steps"])


def test_captured_layers_must_match_draft(capsys, recipe):
    line = _fail(capsys, [recipe(engine={"target_layer_ids": [0, 1, 4]})])
    assert "engine.target_layer_ids=[0, 1, 4] differ from the draft's target_layer_ids [0, 2, 4]" in line


def test_engine_inherits_draft_layers_when_unset(recipe):
    cfg = load_recipe(recipe(engine={"target_layer_ids": []}))
    assert cfg.engine.target_layer_ids == [0, 2, 4]


def test_dspark_min_loss_tokens(capsys, recipe, draft_json):
    d = draft_json(architectures=["DSparkDraftModel"], model_type="dspark")
    line = _fail(capsys, [recipe(draft={"config": d}), "training.min_loss_tokens=13"])
    assert "training.min_loss_tokens=13 must be >= 2 x block_size (14)" in line


def test_world_divisible_by_pp(capsys, recipe):
    line = _fail(capsys, [recipe(engine={"nnodes": 1, "gpus_per_node": 3, "pp_size": 2})])
    assert "engine.pp_size must divide the engine world size" in line


def test_tp_is_world_over_pp(recipe):
    cfg = load_recipe(recipe(engine={"nnodes": 2, "gpus_per_node": 8, "pp_size": 2}))
    assert cfg.engine.tp_size == 8


def test_pp_not_above_layer_count(capsys, recipe):
    line = _fail(capsys, [recipe(engine={"nnodes": 1, "gpus_per_node": 8, "pp_size": 8})])
    assert "engine.pp_size=8 exceeds the target's 6 layers" in line


def test_extra_args_cannot_contradict_pp(capsys, recipe):
    line = _fail(capsys, [recipe(engine={"extra_args": {"pipeline_parallel_size": 2}})])
    assert "engine.extra_args may not set ['pipeline_parallel_size']" in line


def test_capture_ids_must_fit_the_target(capsys, recipe, draft_json):
    d = draft_json(dflash_config={"mask_token_id": 4, "target_layer_ids": [0, 5]})
    line = _fail(capsys, [recipe(draft={"config": d}, engine={"target_layer_ids": [0, 5]})])
    assert "engine.target_layer_ids" in line


def test_subprocess_exit_code_and_single_line(recipe):
    r = subprocess.run(
        [sys.executable, "-m", "hpctoolkit.submit", recipe(), "store.nope=1", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error: unknown key store.nope")
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("recipe_path", ["recipes/tiny.yaml", "recipes/local.yaml"])
def test_config_imports_nothing_heavy(recipe_path):
    # Loading a recipe asks the family table about the draft (models.families), through the
    # hpctoolkit.models package inits: those import nothing, so no torch either. local.yaml's
    # `auto` precisions read the host from files (`config/precision.py`), not through torch.
    code = (
        "import sys, hpctoolkit.config, hpctoolkit.capture, hpctoolkit.submit\n"
        "from hpctoolkit.recipe.load import load_recipe\n"
        f"cfg = load_recipe({recipe_path!r}, [])\n"
        "assert 'auto' not in (cfg.engine.dtype, cfg.training.mixed_precision)\n"
        "bad = [m for m in ('torch', 'vllm', 'mooncake', 'submitit', 'torch.distributed') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_required_marker_over_a_schema_default(capsys, recipe):
    p = recipe()
    d = yaml.safe_load(Path(p).read_text())
    d["data"] = {"prompts": "???"}
    Path(p).write_text(yaml.safe_dump(d))
    assert "data.prompts is required" in _fail(capsys, [p])
    cfg = load_recipe(p, ["data.prompts=builtin:tiny"])
    assert cfg.data.prompts == "builtin:tiny"


def test_pp_stage_with_nothing_to_capture(capsys, recipe, draft_json):
    d = draft_json(dflash_config={"mask_token_id": 4, "target_layer_ids": [0]})
    line = _fail(
        capsys,
        [recipe(draft={"config": d}, engine={"target_layer_ids": [0], "gpus_per_node": 3, "pp_size": 3})],
    )
    assert "leave PP stage(s) [1]" in line


def test_store_sizing_reads_the_target_once_for_load_and_plan(recipe):
    # One home for sizing the store against the target: the couplings at load, and the plan's
    # printout and memory check in `python -m hpctoolkit.submit`.
    from hpctoolkit.plan.placement import make_plan
    from hpctoolkit.recipe.couplings import store_sizing

    cfg = load_recipe(recipe(), [])
    sized = store_sizing(cfg, make_plan(cfg))
    assert (sized.num_layers, list(sized.capture_ids), sized.hidden_size) == (6, [1, 3, 5, 6], 128)
    assert sized.nodes == ()  # per-node memory only for a Slurm plan


def test_validating_a_packaged_target_writes_nothing(tmp_path, monkeypatch, capsys):
    # Loading (and a dry run) checks the recipe against the packaged target's GGUF header; the
    # conversion into the cache is the run's (`submit` before the local roles, or the roles).
    monkeypatch.setenv("HPCTOOLKIT_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "out"
    overrides = [f"paths.output_dir={out}"]
    before = sorted(tmp_path.rglob("*"))
    cfg = load_recipe("recipes/local.yaml", overrides)
    assert cfg.paths.target_model.startswith("pypi:")
    assert main(["recipes/local.yaml", *overrides, "--dry-run"]) == 0
    assert "30 layers" in capsys.readouterr().out  # the header's figures reached the plan
    assert sorted(tmp_path.rglob("*")) == before
    # A bad layer index is still refused at load, against the header's 30 layers.
    with pytest.raises(ConfigError, match=r"engine\.pp_size=31 exceeds the target's 30 layers"):
        load_recipe("recipes/local.yaml", [*overrides, "engine.pp_size=31", "engine.gpus_per_node=31"])
