"""Store, spool, counts and node-memory sizing (`hpctoolkit.plan.sizing`): pure, on CPU, exhaustive
where the space is small; and what `submit --dry-run [--json]` prints of it for the K3 recipes."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hpctoolkit.capture.layout import capture_ids_for, owned_layers, pp_partition
from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.placement import make_plan
from hpctoolkit.plan.sizing import (
    INPUT_IDS_BYTES,
    MASK_BUFFER_BYTES,
    MASK_SEGMENT_MIN,
    check_counts,
    check_node_memory,
    node_memory,
    size_store,
    stage_bytes_per_token,
)
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.slurm.render import load_for_render, render_sbatch
from hpctoolkit.slurm.sinfo import parse_node_memory_mb

ROOT = Path(__file__).resolve().parents[2]
K3_TARGET = {"num_hidden_layers": 61, "hidden_size": 7168}
GiB = 1 << 30


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.fixture
def k3_files(tmp_path):
    """A K3-shaped target config.json and a prompt file, as the done-when command takes them."""
    target = tmp_path / "kimi-k3"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(K3_TARGET))
    prompts = tmp_path / "prompts.jsonl"
    # A dry run reads every data row and checks that the file holds data.num_samples (160000) rows.
    prompts.write_text('{"text": "hello"}\n' * 160_000)
    return target, prompts, tmp_path / "out"


def k3(files, recipe: str = "recipes/k3.yaml", *extra: str):
    target, prompts, out = files
    return load_recipe(
        recipe, [f"paths.output_dir={out}", f"paths.target_model={target}", f"data.prompts={prompts}", *extra]
    )


# -- bytes per token per stage -------------------------------------------------------------------


def test_k3_bytes_per_token_per_stage():
    ids = capture_ids_for([3, 17, 31, 45, 59], 61)
    assert ids == [4, 18, 32, 46, 60, 61]
    # 61 layers over 2 stages split [31, 30]: stage 0 owns ids 4, 18; stage 1 owns 32, 46, 60, 61.
    assert stage_bytes_per_token(ids, 61, 2, 7168, "bfloat16") == [2 * 7168 * 2 + 8, 4 * 7168 * 2]
    # The figure: 6 states x 7168 x bf16 x 8192 tokens = 0.70 GB a sample.
    assert 6 * 7168 * 2 * 8192 == 704_643_072


@pytest.mark.parametrize("num_layers", [4, 7, 32, 61])
def test_every_capture_id_is_counted_once_at_every_pipeline_size(num_layers):
    """Exhaustive over pp sizes and (for small targets) every capture-id choice: the stages'
    bytes add up to the whole sample, whatever the split."""
    hidden, dt = 16, 2
    if num_layers <= 7:
        choices = [
            list(c)
            for r in range(1, num_layers - 1)
            for c in itertools.combinations(range(num_layers - 1), r)
        ]
    else:
        choices = [[3, 17, 29], [0, num_layers - 2], list(range(0, num_layers - 1, 5))]
    for target_ids in choices:
        ids = capture_ids_for(target_ids, num_layers)
        whole = len(ids) * hidden * dt + INPUT_IDS_BYTES
        for pp in range(1, min(num_layers, 8) + 1):
            per = stage_bytes_per_token(ids, num_layers, pp, hidden, "bfloat16")
            assert sum(per) == whole, (target_ids, pp)
            parts = pp_partition(num_layers, pp)
            for s, b in enumerate(per):
                own = owned_layers(ids, num_layers, s, pp, parts)
                assert b == len(own) * hidden * dt + (INPUT_IDS_BYTES if s == 0 else 0)


def test_unknown_dtype_is_refused():
    with pytest.raises(ConfigError, match=r"engine\.dtype"):
        stage_bytes_per_token([1, 4], 4, 1, 8, "int4")


# -- the K3 recipe's figures ---------------------------------------------------------------------


def test_k3_store_figures(k3_files):
    cfg = k3(k3_files)
    s = size_store(cfg, K3_TARGET, make_plan(cfg))
    assert s.longest_sample_tokens == 8192  # data.max_prompt_tokens, below engine.max_model_len
    assert [st.longest_sample_bytes for st in s.stages] == [28680 * 8192, 57344 * 8192]
    assert s.stages[1].longest_sample_bytes == 448 << 20
    assert s.writers == 4 and s.segment_bytes == 128 * GiB and s.store_bytes == 512 * GiB
    assert [st.samples_per_segment for st in s.stages] == [584, 292]
    # Pause at 0.8 of a segment (234 longest stage-1 samples), plus one batch of 16.
    assert s.samples_in_flight == 234 + 16
    assert (s.counts.samples_published, s.counts.samples_consumed, s.counts.epochs) == (160000, 160000, 1)
    assert s.spool_bytes == 0  # one pass: spool off
    busiest = max(s.nodes, key=lambda n: n.total_bytes)
    # An engine leader's node: stage 0's writer and the leader's mask writer (the masks of its
    # 80000 samples, 8 KiB each, twice over, as store.fragments.mask_segment_bytes sizes it).
    assert (busiest.writers, busiest.clients, busiest.workers) == (1, 2, 8)
    mask = 2 * 80000 * 8192 + MASK_BUFFER_BYTES
    assert busiest.total_bytes == 128 * GiB + 16 * GiB + mask + 8 * 64 * GiB


def test_the_mask_segment_is_the_one_the_leader_mounts():
    from hpctoolkit.store.fragments import mask_segment_bytes

    for n, tokens in ((1, 10), (100, 4097), (80000, 8192), (3, 100000)):
        want = mask_segment_bytes([tokens] * n)
        assert max(MASK_SEGMENT_MIN, 2 * n * (-(-tokens // 4096) * 4096)) == want


def test_k3_8nodes_is_the_k3_recipe_with_only_the_layout_changed(k3_files):
    a, b = k3(k3_files), k3(k3_files, "recipes/k3_8nodes.yaml")
    layout = {
        "engine": {"nnodes", "gpus_per_node"},
        "cluster": {"nodes", "gpus_per_node", "trainer_nodes", "trainer_placement", "exclusive", "job_name"},
    }
    for section in ("paths", "data", "draft", "engine", "store", "training", "cluster", "evaluate"):
        da, db = dataclasses.asdict(getattr(a, section)), dataclasses.asdict(getattr(b, section))
        differ = {k for k in da if da[k] != db[k]}
        assert differ <= layout.get(section, set()), (section, differ)
    assert a.name != b.name
    sa, sb = size_store(a, K3_TARGET), size_store(b, K3_TARGET)
    assert dataclasses.replace(sa, nodes=()) == dataclasses.replace(sb, nodes=())


def test_k3_8nodes_plan(k3_files):
    plan = make_plan(k3(k3_files, "recipes/k3_8nodes.yaml"))
    assert (plan.num_nodes, plan.total_gpus, plan.engine_gpus, plan.trainer_gpus) == (8, 40, 32, 8)
    assert plan.idle_gpus == 0
    for e in plan.engines:
        assert (e.tp, e.pp, e.nnodes) == (8, 2, 4)
        # A stage is a node pair: TP=8 over two nodes of 4 GPUs.
        assert [n.pp_stages for n in e.nodes] == [(0,), (0,), (1,), (1,)]
    for node in range(8):
        procs = plan.on_node(node)
        engine_gpus = [g for p in procs if p.role.startswith("engine") for g in p.gpus]
        trainer_gpus = [g for p in procs if p.role == "trainer" for g in p.gpus]
        assert (engine_gpus, trainer_gpus) == ([0, 1, 2, 3], [4])
    assert plan.master is not None and plan.master.node == 0


def test_writers_are_each_stages_tp_rank_zero(k3_files):
    cfg = k3(k3_files, "recipes/k3_8nodes.yaml")
    nodes = node_memory(cfg, make_plan(cfg))
    # Stage 0's TP rank 0 on each engine's first node, stage 1's on its third.
    assert [n.writers for n in nodes] == [1, 0, 1, 0, 1, 0, 1, 0]
    assert [n.clients for n in nodes] == [3, 1, 2, 1, 3, 1, 2, 1]  # + the leaders' mask writers
    assert [n.workers for n in nodes] == [5] * 8


# -- refusals at load ----------------------------------------------------------------------------


def test_segments_that_cannot_hold_the_in_flight_samples_are_refused(k3_files):
    with pytest.raises(ConfigError) as err:
        k3(k3_files, "recipes/k3.yaml", "store.global_segment_size=32GB")
    msg = str(err.value)
    assert "store.global_segment_size=32.0 GiB" in msg and "engine.capture_batch=16" in msg
    assert "raise store.global_segment_size to 35.0 GiB or lower engine.capture_batch to 14" in msg
    assert "\n" not in msg
    k3(k3_files, "recipes/k3.yaml", "store.global_segment_size=36GB")  # just fits


@pytest.mark.parametrize("batch", [1, 2, 5, 16, 40])
@pytest.mark.parametrize("high", [0.5, 0.8, 0.9])
def test_the_in_flight_rule_at_its_boundary(k3_files, batch, high):
    cfg = k3(k3_files)
    longest = 57344 * 8192
    need = math.ceil(batch * longest / (1 - high))
    for seg, ok in ((need + (1 << 20), True), (need - (1 << 20), False)):
        c = dataclasses.replace(
            cfg,
            engine=dataclasses.replace(cfg.engine, capture_batch=batch),
            store=dataclasses.replace(
                cfg.store, global_segment_size=seg, backpressure_high=high, backpressure_low=high / 2
            ),
        )
        if ok:
            s = size_store(c, K3_TARGET)
            assert s.samples_in_flight * longest <= seg + longest
        else:
            with pytest.raises(ConfigError, match="cannot hold the samples in flight"):
                size_store(c, K3_TARGET)


def test_a_segment_below_mooncakes_smallest_is_refused(k3_files):
    with pytest.raises(ConfigError, match="smallest segment"):
        size_store(
            dataclasses.replace(
                k3(k3_files), store=dataclasses.replace(k3(k3_files).store, global_segment_size=8 << 20)
            ),
            K3_TARGET,
        )


def test_watermarks_are_checked():
    with pytest.raises(ConfigError, match=r"store\.backpressure_high"):
        load_recipe("recipes/tiny.yaml", ["store.backpressure_high=0.4", "store.backpressure_low=0.5"])


def _counts_cfg(n: int, steps: int, batch: int, world: int, epochs: int):
    cfg = load_recipe("recipes/tiny.yaml", [])
    t = dataclasses.replace(cfg.training, steps=steps, batch_size=batch, world_size=world, epochs=epochs)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_samples=n), training=t)


def test_the_counts_relation_exhaustively():
    """Accepted iff max((E-1) P, P - b) < steps x b <= E P, with P = n // w and E given or derived."""
    base = load_recipe("recipes/tiny.yaml", [])
    for n, steps, b, w, e in itertools.product(
        range(1, 13), range(1, 13), (1, 2, 3), (1, 2, 4), (0, 1, 2, 3)
    ):
        t = dataclasses.replace(base.training, steps=steps, batch_size=b, world_size=w, epochs=e)
        cfg = dataclasses.replace(base, data=dataclasses.replace(base.data, num_samples=n), training=t)
        p, c = n // w, steps * b
        ok = p >= b
        if ok:
            epochs = e or math.ceil(c / p)
            ok = max((epochs - 1) * p, p - b) < c <= epochs * p
        if ok:
            got = check_counts(cfg)
            assert got.epochs == (e or math.ceil(c / p)) and got.samples_consumed == c * w
        else:
            with pytest.raises(ConfigError):
                check_counts(cfg)


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["data.num_samples=1000000"], "set data.num_samples=160000 or training.steps=125000"),
        (["training.steps=30000"], "set training.epochs=2"),
        (["training.epochs=2"], "set training.epochs=1"),
        (["data.num_samples=4"], "fewer than training.batch_size=1"),
    ],
)
def test_counts_that_disagree_are_refused_with_the_fix(k3_files, overrides, says):
    with pytest.raises(ConfigError, match=None) as err:
        k3(k3_files, "recipes/k3.yaml", *overrides)
    assert says in str(err.value)


def test_a_replay_whose_spool_would_pass_its_bound_is_refused(k3_files):
    with pytest.raises(ConfigError) as err:
        k3(k3_files, "recipes/k3.yaml", "training.steps=40000", "training.epochs=2")
    assert "training.spool_max_size=64.0 GiB" in str(err.value) and "102.5 TiB" in str(err.value)
    cfg = k3(
        k3_files,
        "recipes/k3.yaml",
        "training.steps=40000",
        "training.epochs=2",
        "training.spool_max_size=110TB",
    )
    s = size_store(cfg, K3_TARGET)
    assert s.counts.spooled and s.spool_bytes == 160000 * (28680 + 57344 + 1) * 8192


# -- node memory: sinfo and --mem ----------------------------------------------------------------


def test_sinfo_memory_is_the_smallest_node():
    assert parse_node_memory_mb("515000\n256000+\n 1031000\n") == 256000
    assert parse_node_memory_mb("") is None


def test_a_node_that_cannot_hold_its_share_is_refused(k3_files):
    cfg = k3(k3_files)
    nodes = size_store(cfg, K3_TARGET, make_plan(cfg)).nodes
    check_node_memory(nodes, 2048 * GiB, "gpu")
    with pytest.raises(ConfigError, match=r"node n1 needs 657\.2 GiB .* partition gpu have 512\.0 GiB"):
        check_node_memory(nodes, 512 * GiB, "gpu")


@pytest.mark.parametrize(
    ("recipe", "mem"),
    # segments + buffers + the leader's mask writer (1250 MiB + 16 MiB) + 64 GiB per worker, in MiB
    [
        ("recipes/k3.yaml", 131072 + 16384 + 1266 + 8 * 65536),
        ("recipes/k3_8nodes.yaml", 131072 + 2 * 16384 + 1266 + 5 * 65536),
    ],
)
def test_the_batch_script_asks_the_memory_it_needs(recipe, mem):
    cfg, _ = load_for_render(recipe)
    text = render_sbatch(cfg, make_plan(cfg), recipe_path=recipe)
    assert f"#SBATCH --mem={mem}M\n" in text
    assert ("#SBATCH --exclusive" in text) == (recipe == "recipes/k3.yaml")
    # A script bash accepts, with the engine and trainer steps sharing nodes in the 8-node layout.
    assert subprocess.run(["bash", "-n"], input=text, text=True, check=False).returncode == 0
    if recipe.endswith("8nodes.yaml"):
        assert "#SBATCH --gpus-per-node=5\n" in text and text.count("--gres=gpu:4 ") == 8
        assert '--nodelist="$(hosts 0 1 2 3 4 5 6 7)" --gres=gpu:1' in text


def test_no_memory_request_without_a_worker_allowance():
    cfg, _ = load_for_render("tests/golden/small_2node.yaml")
    assert "--mem" not in render_sbatch(cfg, make_plan(cfg), recipe_path="x.yaml")


# -- the dry run ---------------------------------------------------------------------------------


def _submit(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpctoolkit.submit", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(("recipe", "nodes"), [("recipes/k3.yaml", 5), ("recipes/k3_8nodes.yaml", 8)])
def test_dry_run_json_prints_the_plan_and_the_store(k3_files, recipe, nodes):
    target, prompts, out = k3_files
    p = _submit(
        recipe,
        "--dry-run",
        "--json",
        f"paths.output_dir={out}",
        f"paths.target_model={target}",
        f"data.prompts={prompts}",
    )
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert (d["nodes"], d["total_gpus"], d["inference_gpus"], d["training_gpus"]) == (nodes, 40, 32, 8)
    assert (
        [(e["tp"], e["pp"], len(e["nodes"]), e["leader"]) for e in d["engines"]]
        == [
            (8, 2, 2, 1),
            (8, 2, 2, 3),
        ]
        if nodes == 5
        else [(8, 2, 4, 0), (8, 2, 4, 4)]
    )
    st = d["store"]
    assert st["segment_bytes"] == 128 * GiB and st["writers"] == 4 and st["samples_in_flight"] == 250
    assert st["counts"]["epochs"] == 1 and st["spool_bytes"] == 0
    assert not out.exists()  # a dry run starts nothing


def test_dry_run_text_prints_the_sizing(k3_files):
    target, prompts, out = k3_files
    p = _submit(
        "recipes/k3.yaml",
        "--dry-run",
        f"paths.output_dir={out}",
        f"paths.target_model={target}",
        f"data.prompts={prompts}",
    )
    assert p.returncode == 0, p.stderr
    assert "4 writer segment(s) x 128.0 GiB" in p.stdout and "spool       off" in p.stdout


@pytest.mark.parametrize("missing", ["data.prompts", "draft.config", "paths.target_model"])
def test_dry_run_checks_the_files_exist(k3_files, missing):
    target, prompts, out = k3_files
    given = {
        "paths.target_model": str(target),
        "data.prompts": str(prompts),
        "draft.config": "recipes/draft_models/kimi_k3_dspark_mla.json",
    }
    given[missing] = str(out / "nope")
    p = _submit(
        "recipes/k3.yaml", "--dry-run", f"paths.output_dir={out}", *(f"{k}={v}" for k, v in given.items())
    )
    assert p.returncode == 2
    assert missing in p.stderr and len([x for x in p.stderr.splitlines() if x.strip()]) == 1, p.stderr


def test_json_needs_dry_run(k3_files):
    p = _submit("recipes/tiny.yaml", "--json")
    assert p.returncode == 2 and "--dry-run" in p.stderr


def _fake_sinfo(tmp_path: Path, mb: str) -> dict[str, str]:
    import os

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    sinfo = bin_dir / "sinfo"
    sinfo.write_text(f"#!/bin/sh\nprintf '{mb}\\n'\n")
    sinfo.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize(("mb", "ok"), [("2063000\n1031000", True), ("1031000\n515000+", False)])
def test_dry_run_checks_node_memory_where_sinfo_reports_it(k3_files, tmp_path, mb, ok):
    target, prompts, out = k3_files
    args = [f"paths.output_dir={out}", f"paths.target_model={target}", f"data.prompts={prompts}"]
    p = subprocess.run(
        [sys.executable, "-m", "hpctoolkit.submit", "recipes/k3.yaml", "--dry-run", "--json", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=_fake_sinfo(tmp_path, mb),
    )
    if ok:
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["node_memory_bytes"] == 1031000 << 20
    else:
        assert p.returncode == 2
        assert "node n1 needs 657.2 GiB" in p.stderr and "(sinfo)" in p.stderr, p.stderr
