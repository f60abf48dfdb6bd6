"""training.init_layers_from_target: draft decoder layers start from the target's own layers."""

from __future__ import annotations

import pytest
import torch

from hpctoolkit.errors import ConfigError
from hpctoolkit.targets.resolve import resolve_target
from hpctoolkit.train.build import build_trainer
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.target_head import read_target_layer_tensor, read_target_tensor

DRAFT = "recipes/draft_models/tiny_dflash.json"


@pytest.fixture(scope="module")
def target():
    return resolve_target("builtin:tiny-qwen3")


def test_draft_layer_takes_the_target_layer_and_final_norm(target):
    trainer = build_trainer(DRAFT, target, TrainingConfig(init_layers_from_target=[4, 5]))
    draft = trainer.draft
    for i, t in enumerate([4, 5]):
        for rest in ("self_attn.q_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight"):
            want = read_target_layer_tensor(target, t, rest)
            got = dict(draft.named_parameters())[f"layers.{i}.{rest}"]
            assert torch.equal(got.to(want.dtype), want), (i, rest)
    assert torch.equal(draft.norm.weight.to(torch.bfloat16), read_target_tensor(target, "norm.weight"))
    fresh = build_trainer(DRAFT, target, TrainingConfig()).draft
    assert not torch.equal(fresh.layers[0].self_attn.q_proj.weight, draft.layers[0].self_attn.q_proj.weight)


def test_refusals_are_one_line(target):
    with pytest.raises(ConfigError, match=r"lists 3 layers; the draft has 2 decoder layers"):
        build_trainer(DRAFT, target, TrainingConfig(init_layers_from_target=[1, 2, 3]))
    with pytest.raises(ConfigError, match=r"target layer 40 .* has no tensor matching draft layer 0"):
        build_trainer(DRAFT, target, TrainingConfig(init_layers_from_target=[40]))
    with pytest.raises(ConfigError, match=r"init_layers_from_target"):
        TrainingConfig(init_layers_from_target=[-1]).validate()
