"""The recipe's data section: its own checks, and regeneration on every engine layout."""

from __future__ import annotations

import pytest

from hpctoolkit.errors import ConfigError
from hpctoolkit.recipe.load import load_recipe


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("data.loss_mask=everything", r"data.loss_mask must be one of"),
        (
            "data.system_prompt_policy=replace",
            r"data.system_prompt must be set for system_prompt_policy=replace",
        ),
        ("data.regenerate_top_p=0", r"data.regenerate_top_p must lie in \(0, 1\]"),
        ("data.regenerate_max_bad_fraction=2", r"data.regenerate_max_bad_fraction must lie in \[0, 1\]"),
        ("data.format=csv", r"data.format must be one of"),
        ("data.sources=[{path: a.jsonl, weight: 0}]", r"data.sources\[0\].weight must be > 0"),
    ],
)
def test_bad_data_settings_name_the_key(override, match):
    with pytest.raises(ConfigError, match=match):
        load_recipe("recipes/tiny.yaml", [override])


def test_regeneration_runs_on_the_engines_layout_over_its_nodes(tmp_path):
    """A multi-node engine regenerates too (its followers serve the generating engine first), on a
    rendezvous of its own (picked at start, recorded apart from the capture engine's)."""
    from hpctoolkit.plan.placement import make_plan
    from hpctoolkit.plan.ports import engine_listener

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    over = [f"data.prompts={rows}", "data.num_samples=4", "data.regenerate_tokens=8"]
    cfg = load_recipe("tests/recipes/multihost.yaml", over)
    e = make_plan(cfg).engines[0]
    assert e.nnodes == 2 and engine_listener(0, generating=True) != engine_listener(0)
    cfg = load_recipe(
        "recipes/tiny.yaml", ["engine.gpus_per_node=2", "engine.pp_size=2", "data.regenerate_tokens=8"]
    )
    assert cfg.engine.world_size == 2


def test_a_pruned_vocabulary_loads_with_a_live_source():
    """A live run's pruned vocabulary comes from the engines' counts (tests/e2e/test_live_vocab.py),
    so the recipe loads with or without a saved one."""
    live = ["draft.config=recipes/draft_models/tiny_eagle3.json", "engine.target_layer_ids=[0,1,2]"]
    assert load_recipe("recipes/tiny.yaml", live).training.data_source == "live"
    load_recipe("recipes/tiny.yaml", [*live, "data.draft_vocab=/runs/a/train/draft_vocab.json"])
