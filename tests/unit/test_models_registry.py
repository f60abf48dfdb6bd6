"""Registry resolution from JSON (both directions), duplicates, checkpoints, export and inspect CLIs."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.checkpoint import load_draft, save_draft
from hpctoolkit.models.dflash.config import DFlashConfig
from hpctoolkit.models.dflash.model import DFlashDraftModel
from hpctoolkit.models.dflash.serving import SERVING as DFLASH
from hpctoolkit.models.dspark.config import DSparkConfig
from hpctoolkit.models.dspark.model import DSparkDraftModel
from hpctoolkit.models.eagle3.config import Eagle3Config
from hpctoolkit.models.eagle3.model import Eagle3DraftModel
from hpctoolkit.models.export import main as export_main
from hpctoolkit.models.families import families, register_serving, serving_for
from hpctoolkit.models.inspect import main as inspect_main
from hpctoolkit.models.k3_dspark.config import K3DSparkConfig
from hpctoolkit.models.k3_dspark.model import K3DSparkModel
from hpctoolkit.models.registry import (
    architecture_for,
    build_draft_model,
    config_class_for,
    family_of,
    family_parts,
    load_draft_config,
    model_class_for,
    register_draft,
    trainer_class_for,
)

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "draft_models"

EXPECTED = {
    "kimi_k3_dspark_mla.json": (K3DSparkConfig, K3DSparkModel),
    "tiny_k3_dspark_mla.json": (K3DSparkConfig, K3DSparkModel),
    "qwen3_8b_dspark.json": (DSparkConfig, DSparkDraftModel),
    "tiny_dspark.json": (DSparkConfig, DSparkDraftModel),
    "qwen3_8b_dflash.json": (DFlashConfig, DFlashDraftModel),
    "tiny_dflash.json": (DFlashConfig, DFlashDraftModel),
    "qwen3_8b_eagle3.json": (Eagle3Config, Eagle3DraftModel),
    "tiny_eagle3.json": (Eagle3Config, Eagle3DraftModel),
    "smollm2_dflash.json": (DFlashConfig, DFlashDraftModel),
    "smollm2_eagle3.json": (Eagle3Config, Eagle3DraftModel),
}


def test_every_recipe_is_covered():
    assert {p.name for p in RECIPES.glob("*.json")} == set(EXPECTED)


@pytest.mark.parametrize(("name", "classes"), EXPECTED.items())
def test_recipe_resolves_to_exact_classes(name, classes):
    config = load_draft_config(RECIPES / name)
    assert type(config) is classes[0]
    assert model_class_for(config) is classes[1]
    assert type(build_draft_model(config, device="meta")) is classes[1]


def test_k3_json_resolves_to_k3_and_stays_a_dspark_config():
    data = json.loads((RECIPES / "kimi_k3_dspark_mla.json").read_text())
    assert config_class_for(data) is K3DSparkConfig
    assert config_class_for({"model_type": "k3_dspark"}) is K3DSparkConfig
    config = load_draft_config(RECIPES / "kimi_k3_dspark_mla.json")
    assert isinstance(config, DSparkConfig)  # DSpark trainer dispatch keeps working
    assert model_class_for(config) is K3DSparkModel  # but the model is found by exact type
    assert issubclass(K3DSparkModel, DSparkDraftModel)


def test_dspark_json_does_not_resolve_to_k3():
    config = load_draft_config(RECIPES / "tiny_dspark.json")
    assert type(config) is DSparkConfig and model_class_for(config) is DSparkDraftModel


def test_miss_lists_known_names():
    with pytest.raises(ConfigError, match=r"known: .*K3DSparkModel.*k3_dspark"):
        config_class_for({"architectures": ["NopeModel"], "model_type": "nope"})

    class Orphan(DFlashConfig):
        model_type = "orphan"

    with pytest.raises(ConfigError, match=r"known: .*K3DSparkConfig"):
        model_class_for(
            Orphan(
                target_layer_ids=[0],
                mask_token_id=1,
                vocab_size=8,
                hidden_size=8,
                num_attention_heads=1,
                num_key_value_heads=1,
            )
        )


def test_duplicates_are_rejected():
    class Again(DFlashConfig):
        model_type = "again_draft"

    again = replace(DFLASH, family="again", model_type="again_draft", architectures=("K3DSparkModel",))
    with pytest.raises(ConfigError, match="'K3DSparkModel' is already registered to 'k3_dspark'"):
        register_serving(again)
    with pytest.raises(ConfigError, match="family 'dflash' is already registered"):
        register_serving(replace(again, family="dflash", architectures=("New",)))
    with pytest.raises(ConfigError, match=r"no draft registered for Again \(model_type='again_draft'\)"):
        register_draft(Again, DFlashDraftModel, trainer_class_for("dflash"))
    with pytest.raises(ConfigError, match="K3DSparkConfig is already registered to 'k3_dspark'"):
        register_draft(K3DSparkConfig, K3DSparkModel, trainer_class_for("k3_dspark"))
    with pytest.raises(ConfigError, match="no draft registered"):
        config_class_for({"architectures": ["SomethingNew"]})
    assert "again" not in families()


@pytest.mark.parametrize(("name", "classes"), EXPECTED.items())
def test_every_recipe_has_a_serving_record_matching_its_class(name, classes):
    config = load_draft_config(RECIPES / name)
    serving = serving_for(config)
    data = json.loads((RECIPES / name).read_text())
    assert serving is serving_for(RECIPES / name) is serving_for(data) is serving_for(classes[0])
    assert serving.model_type == classes[0].model_type
    assert serving.family in families()
    assert architecture_for(config) == serving.architectures[0]


def test_serving_records_say_what_vllm_cpu_cannot_serve():
    assert {
        f: serving_for({"model_type": m}).cpu_unservable is not None
        for f, m in [
            ("eagle3", "eagle3_draft"),
            ("dflash", "dflash_draft"),
            ("dspark", "dspark_draft"),
            ("k3_dspark", "k3_dspark"),
        ]
    } == {"eagle3": False, "dflash": False, "dspark": True, "k3_dspark": True}
    assert serving_for({"architectures": ["Qwen3DSparkModel"]}).vllm_method == "dspark"
    assert serving_for({"architectures": ["K3DSparkModel"]}).vllm_method == "dspark"
    assert serving_for({"architectures": ["Eagle3LlamaForCausalLM"]}).vllm_method == "eagle3"
    with pytest.raises(ConfigError, match=r"known: .*DFlashDraftModel"):
        serving_for({"architectures": ["Nope"]})


def test_serving_records_import_nothing_heavy():
    """The records and the family table import no torch (and the package inits import nothing)."""
    import ast

    root = Path(__file__).resolve().parents[2] / "hpctoolkit" / "models"
    for path in [root / "serving.py", root / "families.py", *root.glob("*/serving.py")]:
        tree = ast.parse(path.read_text())
        imported = {
            n.module if isinstance(n, ast.ImportFrom) else a.name
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in n.names
        }
        heavy = {m for m in imported if m and m.split(".")[0] in ("torch", "transformers", "safetensors")}
        assert not heavy, (path, heavy)
        modules = {m for m in imported if m and m.startswith("hpctoolkit.")}
        allowed = {
            "hpctoolkit.errors",
            "hpctoolkit.models.serving",
            "hpctoolkit.models.dflash",
            "hpctoolkit.models.dspark",
            "hpctoolkit.rundir.atomic",  # standard library only: the one JSON-object reader
        }
        allowed |= {f"hpctoolkit.models.{f}.serving" for f in families()}
        configs = {m for m in modules if m.endswith(".config")}  # TYPE_CHECKING only
        assert modules - configs <= allowed, (path, modules)


def test_models_package_inits_import_nothing():
    """A recipe's couplings reach `models.families` through these inits: they hold a docstring only."""
    import ast

    root = Path(__file__).resolve().parents[2] / "hpctoolkit" / "models"
    for path in [root / "__init__.py", *root.glob("*/__init__.py")]:
        body = ast.parse(path.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), path


@pytest.mark.parametrize(
    "name", ["tiny_eagle3.json", "tiny_dflash.json", "tiny_dspark.json", "tiny_k3_dspark_mla.json"]
)
def test_save_load_export_round_trip(tmp_path, name, capsys):
    torch.manual_seed(0)
    config = load_draft_config(RECIPES / name)
    model = build_draft_model(config)
    save_draft(model, tmp_path / "ckpt")
    again = load_draft(tmp_path / "ckpt")
    assert type(again.config) is type(config)
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k

    assert export_main([str(tmp_path / "ckpt"), str(tmp_path / "served"), "--dtype", "float32"]) == 0
    served_cfg = json.loads((tmp_path / "served" / "config.json").read_text())
    # The served config.json resolves back to the same classes (the other direction).
    back = load_draft_config(tmp_path / "served")
    assert type(back) is type(config)
    assert served_cfg["architectures"][0] in {
        "Eagle3Qwen3ForCausalLM",
        "DFlashDraftModel",
        "Qwen3DSparkModel",
        "K3DSparkModel",
    }
    assert back.rope_theta == config.rope_theta


def test_export_refuses_a_mismatched_state_dict(tmp_path):
    from hpctoolkit.models.export import export_draft

    config = load_draft_config(RECIPES / "tiny_dflash.json")
    state = build_draft_model(config).state_dict()
    state.pop("fc.weight")
    with pytest.raises(ConfigError, match=r"missing \['fc.weight'\]"):
        export_draft(state, config, tmp_path)


def test_dflash_fc_norm_export_is_refused(tmp_path):
    data = json.loads((RECIPES / "tiny_dflash.json").read_text())
    data.pop("model_type")
    config = DFlashConfig(**data, fc_norm=True)
    from hpctoolkit.models.export import export_draft

    with pytest.raises(ConfigError, match=r"fc_norm: vLLM 0\.32 DFlashQwen3Model"):
        export_draft(build_draft_model(config), config, tmp_path)


def test_inspect_prints_classes_rotary_and_shapes(capsys):
    assert inspect_main([str(RECIPES / "kimi_k3_dspark_mla.json")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config_class"].endswith("K3DSparkConfig")
    assert any(b.endswith("DSparkConfig") for b in report["config_bases"])
    assert report["model_class"].endswith("K3DSparkModel")
    assert report["rotary"]["base"] == 50000.0 and report["rotary"]["type"] == "yarn"
    assert report["rotary"]["interleaved"] is True
    assert report["state_dict"]["layers.4.self_attn.kv_b_proj.weight"] == [64 * 256, 512]
    assert report["state_dict"]["embed_tokens.weight"] == [163840, 7168]


def test_every_family_has_a_trainer_and_a_miss_lists_the_families():
    from hpctoolkit.models.dflash.trainer import DFlashTrainer
    from hpctoolkit.models.dspark.trainer import DSparkTrainer
    from hpctoolkit.models.eagle3.trainer import Eagle3Trainer

    for name, (config_cls, _) in EXPECTED.items():
        config = load_draft_config(RECIPES / name)
        want = {Eagle3Config: Eagle3Trainer, DFlashConfig: DFlashTrainer}.get(config_cls, DSparkTrainer)
        assert trainer_class_for(config) is want is trainer_class_for(family_of(config))
    with pytest.raises(
        ConfigError, match=r"no draft family 'nope'; known: dflash, dspark, eagle3, k3_dspark"
    ):
        trainer_class_for("nope")


def test_a_familys_parts_all_come_from_its_own_folder():
    """Config, model, serving record, trainer and the trainer's loss of each family live in
    `models/<family>/`; a family without a trainer of its own (K3 DSpark) trains with that of the
    family its config extends. `train/` holds no family's code."""
    import importlib
    import importlib.util
    import sys

    for family in families():
        parts = family_parts(family)
        own = f"hpctoolkit.models.{family}"
        assert parts.config_cls.__module__ == f"{own}.config"
        assert parts.model_cls.__module__ == f"{own}.model"
        assert parts.serving is importlib.import_module(f"{own}.serving").SERVING
        if importlib.util.find_spec(f"{own}.trainer") is not None:
            home = own
        else:
            bases = [
                f
                for f in families()
                if f != family and issubclass(parts.config_cls, family_parts(f).config_cls)
            ]
            home = f"hpctoolkit.models.{max(bases, key=lambda f: len(family_parts(f).config_cls.__mro__))}"
        assert parts.trainer_cls.__module__ == f"{home}.trainer", family
        trainer_module = vars(sys.modules[parts.trainer_cls.__module__])
        losses = {v.__module__ for k, v in trainer_module.items() if k.endswith("_loss") and callable(v)}
        assert losses == {f"{home}.loss"}, (family, losses)
    train = Path(__file__).resolve().parents[2] / "hpctoolkit" / "train"
    assert not [p for f in families() for p in train.rglob(f"{f}.py")]


def test_export_takes_flags_in_any_order(tmp_path):
    config = load_draft_config(RECIPES / "tiny_dflash.json")
    save_draft(build_draft_model(config), tmp_path / "ckpt")
    ckpt = str(tmp_path / "ckpt")
    assert export_main(["--dtype", "float32", ckpt, str(tmp_path / "a")]) == 0
    assert export_main([ckpt, "--dtype", "float16", str(tmp_path / "b")]) == 0
    assert json.loads((tmp_path / "a" / "config.json").read_text())["torch_dtype"] == "float32"
    assert json.loads((tmp_path / "b" / "config.json").read_text())["torch_dtype"] == "float16"


def test_builtin_target_takes_flags_in_any_order(monkeypatch, capsys):
    from hpctoolkit.targets import builtin

    built = []
    monkeypatch.setattr(builtin, "build", lambda name, out: built.append((name, out)) or Path(out))
    assert builtin.main(["--arch", "llama", "out1"]) == 0
    assert builtin.main(["out2", "--arch", "llama"]) == 0
    assert built == [("tiny-llama", "out1"), ("tiny-llama", "out2")]


def test_evaluate_takes_flags_in_any_order():
    from hpctoolkit.cli import parse
    from hpctoolkit.evaluate.__main__ import build_parser

    a = parse(build_parser(), ["--target", "T", "EXP", "--max-tokens", "5", "--num-prompts", "2"])
    b = parse(build_parser(), ["EXP", "--num-prompts", "2", "--target", "T", "--max-tokens", "5"])
    assert a == b and (a.export_dir, a.target, a.max_tokens, a.num_prompts) == ("EXP", "T", 5, 2)


def _entry_points():
    from hpctoolkit.evaluate.__main__ import main as evaluate_main
    from hpctoolkit.targets.builtin import main as tiny_main

    return {
        "hpctoolkit.models.export": (export_main, ["ckpt", "out"]),
        "hpctoolkit.models.inspect": (inspect_main, ["config.json"]),
        "hpctoolkit.evaluate": (evaluate_main, ["export", "--target", "t"]),
        "hpctoolkit.targets.builtin": (tiny_main, ["out"]),
    }


@pytest.mark.parametrize(
    "prog",
    [
        "hpctoolkit.models.export",
        "hpctoolkit.models.inspect",
        "hpctoolkit.evaluate",
        "hpctoolkit.targets.builtin",
    ],
)
def test_a_bad_flag_is_exit_2_with_one_line(prog, capsys):
    from hpctoolkit.cli import run_cli

    main, argv = _entry_points()[prog]
    with pytest.raises(SystemExit) as info:
        run_cli(main, [*argv[:1], "--nope", *argv[1:]])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    assert len(err) == 1 and err[0].startswith(f"error: python -m {prog}: unrecognized arguments: --nope"), (
        err
    )
    with pytest.raises(SystemExit) as info:
        run_cli(main, ["--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m {prog}")


@pytest.mark.parametrize("prog", ["hpctoolkit.models.export", "hpctoolkit.targets.builtin"])
def test_python_m_reports_a_bad_flag_in_one_line(prog):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", prog, *_entry_points()[prog][1], "--nope"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: python -m {prog}: unrecognized arguments: --nope"]


# The speculative tokens each recipe's draft was trained to propose: block families
# `block_size - 1` (slot 0 is the known anchor), Eagle3 the run's `training.ttt_length`.
TRAINED_DEPTH = {
    "kimi_k3_dspark_mla.json": (6, "block_size 7"),
    "tiny_k3_dspark_mla.json": (6, "block_size 7"),
    "qwen3_8b_dspark.json": (6, "block_size 7"),
    "tiny_dspark.json": (6, "block_size 7"),
    "qwen3_8b_dflash.json": (15, "block_size 16"),
    "tiny_dflash.json": (3, "block_size 4"),
    "smollm2_dflash.json": (3, "block_size 4"),
    "qwen3_8b_eagle3.json": (5, "training.ttt_length 5"),
    "tiny_eagle3.json": (5, "training.ttt_length 5"),
    "smollm2_eagle3.json": (5, "training.ttt_length 5"),
}


def test_every_family_declares_its_trained_depth():
    from hpctoolkit.models.families import serving_of_family

    assert set(TRAINED_DEPTH) == set(EXPECTED)
    covered = {serving_for(RECIPES / name).family for name in TRAINED_DEPTH}
    assert covered == set(families())
    assert all(serving_of_family(f).title for f in families())


@pytest.mark.parametrize(("name", "want"), TRAINED_DEPTH.items())
def test_trained_depth_reads_the_draft_json_its_config_and_its_export_alike(name, want):
    from hpctoolkit.models.families import trained_depth
    from hpctoolkit.models.serving import TrainedDepth

    config = load_draft_config(RECIPES / name)
    serving = serving_for(config)
    served = serving.config_fields(config) | {"architectures": [serving.served_architecture]}
    for source in (RECIPES / name, str(RECIPES / name), config, served):
        assert trained_depth(source, ttt_length=5) == TrainedDepth(*want), source


def test_trained_depth_defaults_and_unknowns():
    from hpctoolkit.models.families import trained_depth

    def depth(draft, **kw):
        got = trained_depth(draft, **kw)
        return None if got is None else got.depth

    # A config.json without block_size: the config class's default (DFlash 16, DSpark 7).
    assert depth({"model_type": "dflash_draft"}) == 15
    assert depth({"model_type": "dspark_draft"}) == 6 and depth({"model_type": "k3_dspark"}) == 6
    assert depth({"model_type": "dflash_draft", "dflash_config": {"block_size": 5}}) == 4
    assert depth({"architectures": ["DFlashDraftModel"], "block_size": 8}, ttt_length=2) == 7
    # Eagle3's depth is a training setting its config.json does not carry: unknown without it.
    assert depth({"model_type": "eagle3_draft"}) is None
    assert depth({"architectures": ["Eagle3Qwen3ForCausalLM"]}, ttt_length=3) == 3
    with pytest.raises(ConfigError, match="no draft registered"):
        trained_depth({"model_type": "nope"})
