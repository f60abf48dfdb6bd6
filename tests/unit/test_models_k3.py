"""Kimi-K3 DSpark MLA draft: config normalisation, pinned layout, gate refusal, training reach."""

import json
from pathlib import Path

import pytest
import torch

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.dflash.layout import make_block_layout
from hpctoolkit.models.dspark.config import DSparkConfig
from hpctoolkit.models.dspark.loss import dspark_ce_loss
from hpctoolkit.models.k3_dspark.config import K3DSparkConfig
from hpctoolkit.models.k3_dspark.model import K3DSparkModel
from hpctoolkit.models.registry import build_draft_model, load_draft_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "draft_models"
K3_RECIPE = RECIPES / "kimi_k3_dspark_mla.json"
TINY_K3 = RECIPES / "tiny_k3_dspark_mla.json"

MLA_LAYER_SHAPES = {  # name -> shape as a function of the config
    "input_layernorm.weight": lambda c: [c.hidden_size],
    "self_attn.q_a_proj.weight": lambda c: [c.q_lora_rank, c.hidden_size],
    "self_attn.q_a_layernorm.weight": lambda c: [c.q_lora_rank],
    "self_attn.q_b_proj.weight": lambda c: [
        c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim),
        c.q_lora_rank,
    ],
    "self_attn.kv_a_proj_with_mqa.weight": lambda c: [c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size],
    "self_attn.kv_a_layernorm.weight": lambda c: [c.kv_lora_rank],
    "self_attn.kv_b_proj.weight": lambda c: [
        c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
        c.kv_lora_rank,
    ],
    "self_attn.o_proj.weight": lambda c: [c.hidden_size, c.num_attention_heads * c.v_head_dim],
    "post_attention_layernorm.weight": lambda c: [c.hidden_size],
    "mlp.gate_proj.weight": lambda c: [c.intermediate_size, c.hidden_size],
    "mlp.up_proj.weight": lambda c: [c.intermediate_size, c.hidden_size],
    "mlp.down_proj.weight": lambda c: [c.hidden_size, c.intermediate_size],
}


def _expected_layout(c: K3DSparkConfig) -> dict[str, list[int]]:
    out = {
        "embed_tokens.weight": [c.vocab_size, c.hidden_size],
        "context_proj.weight": [c.hidden_size, c.num_target_layers * c.target_hidden_size],
        "context_norm.weight": [c.hidden_size],
        "final_norm.weight": [c.hidden_size],
        "lm_head.weight": [c.draft_vocab_size, c.hidden_size],
        "markov_head.markov_w1.weight": [c.vocab_size, c.markov_rank],
        "markov_head.markov_w2.weight": [c.draft_vocab_size, c.markov_rank],
        "confidence_head.proj.weight": [1, c.hidden_size + c.markov_rank],
        "confidence_head.proj.bias": [1],
    }
    if c.fc_norm:
        out |= {f"fc_norm.{i}.weight": [c.target_hidden_size] for i in range(c.num_target_layers)}
    for i in range(c.num_hidden_layers):
        out |= {f"layers.{i}.{k}": f(c) for k, f in MLA_LAYER_SHAPES.items()}
    return out


@pytest.mark.parametrize("recipe", [K3_RECIPE, TINY_K3])
def test_state_dict_layout_is_pinned_to_mla_names_and_shapes(recipe):
    config = load_draft_config(recipe)
    model = build_draft_model(config, device="meta")
    got = {k: list(v.shape) for k, v in model.state_dict().items()}
    assert got == _expected_layout(config)
    assert not any("q_norm" in k or "k_norm" in k for k in got)


def test_k3_recipe_shapes():
    c = load_draft_config(K3_RECIPE)
    assert (c.hidden_size, c.vocab_size, c.num_attention_heads) == (7168, 163840, 64)
    assert (c.q_lora_rank, c.kv_lora_rank) == (1536, 512)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (128, 64, 128)
    assert c.rope_parameters["rope_type"] == "yarn"
    assert c.rope_theta == c.rope_parameters["rope_theta"] == 50000.0
    assert c.fc_norm
    assert c.num_target_layers == len(c.target_layer_ids) == 5


def test_output_gate_is_rejected():
    data = json.loads(TINY_K3.read_text()) | {"mla_use_output_gate": True}
    config = K3DSparkConfig(**{k: v for k, v in data.items() if k != "model_type"})
    with pytest.raises(NotImplementedError, match="mla_use_output_gate"):
        K3DSparkModel(config)


def test_nope_is_not_a_knob():
    data = json.loads(TINY_K3.read_text())
    data.pop("model_type")
    with pytest.raises(ConfigError, match="mla_use_nope"):
        K3DSparkConfig(**data, mla_use_nope=True)


def _tiny_kwargs(**over):
    data = json.loads(TINY_K3.read_text())
    data.pop("model_type")
    data.pop("rope_parameters")
    return data | over


def test_rope_normalisation_collapses_spellings_and_lifts_theta():
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0}
    c = K3DSparkConfig(**_tiny_kwargs(rope_parameters=dict(yarn)))
    assert c.rope_theta == 50000.0 and c.rope_parameters["rope_theta"] == 50000.0
    # Partial YaRN block: DeepSeek's defaults fill what is missing, the given factor stays.
    assert c.rope_parameters["factor"] == 8.0
    assert c.rope_parameters["original_max_position_embeddings"] == 4096
    assert c.rope_parameters["beta_fast"] == 32.0 and c.rope_parameters["mscale_all_dim"] == 1.0
    assert c.rope_scaling == c.rope_parameters  # one dict, two spellings

    legacy = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 512}
    both = K3DSparkConfig(**_tiny_kwargs(rope_scaling=legacy, rope_parameters=dict(yarn), rope_theta=20000.0))
    assert both.rope_parameters["factor"] == 2.0  # explicit legacy rope_scaling wins
    assert both.rope_theta == 20000.0

    round_trip = K3DSparkConfig(**{k: v for k, v in c.to_dict().items() if k != "model_type"})
    assert round_trip.rope_parameters == c.rope_parameters
    assert round_trip.rope_theta == 50000.0

    default = K3DSparkConfig(**_tiny_kwargs())
    assert default.rope_theta == 50000.0 and default.rope_parameters["rope_type"] == "default"


def test_k3_is_still_a_dspark_config():
    c = load_draft_config(TINY_K3)
    assert type(c) is K3DSparkConfig
    assert isinstance(c, DSparkConfig)


def test_forward_backward_reaches_mla_markov_and_confidence_while_embedding_stays_frozen():
    torch.manual_seed(0)
    config = load_draft_config(TINY_K3)
    model = build_draft_model(config)
    B, S = 2, 40
    ids = torch.randint(0, config.vocab_size - 1, (B, S))
    context = torch.randn(B, S, config.num_target_layers * config.target_hidden_size)
    layout = make_block_layout(torch.tensor([[5, 17, 30], [2, 11, 25]]), config.block_size, S)
    out = model(context, ids, layout)
    assert out.hidden_BTH.shape == (B, 3 * config.block_size, config.hidden_size)
    assert out.confidence_BT.shape == (B, 3 * config.block_size)
    dspark_ce_loss(model, out, layout.labels(ids)).total.backward()
    for name in (
        "layers.0.self_attn.q_a_proj.weight",
        "layers.1.self_attn.kv_b_proj.weight",
        "layers.1.self_attn.o_proj.weight",
        "markov_head.markov_w1.weight",
        "markov_head.markov_w2.weight",
        "confidence_head.proj.weight",
        "context_proj.weight",
    ):
        grad = model.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert not model.embed_tokens.weight.requires_grad
    assert model.embed_tokens.weight.grad is None


def test_v_is_not_rotated_and_q_k_positions_are_separate():
    torch.manual_seed(0)
    config = load_draft_config(TINY_K3)
    attn = build_draft_model(config).layers[0].self_attn
    rot = build_draft_model(config, device="meta").rotary_emb
    x = torch.randn(1, 3, config.hidden_size)
    from hpctoolkit.models.common.attention import causal_mask

    mask = causal_mask(1, 3, x.device)
    pos = torch.arange(3).unsqueeze(0)
    base = attn(x, x, rot(pos), rot(pos), mask)
    # Shifting Q and K positions together leaves q.k unchanged (relative RoPE), and V unrotated.
    shifted = attn(x, x, rot(pos + 100), rot(pos + 100), mask)
    torch.testing.assert_close(shifted, base, rtol=1e-4, atol=1e-5)
    # Moving only the K side changes the scores, so the sides really are independent.
    assert not torch.allclose(attn(x, x, rot(pos), rot(pos + 7), mask), base, atol=1e-4)
    # The first query attends to one key only, so its output is exactly o_proj(V): V is never rotated.
    one = attn(x[:, :1], x[:, :1], rot(pos[:, :1]), rot(pos[:, :1] + 50), causal_mask(1, 1, x.device))
    torch.testing.assert_close(one, base[:, :1], rtol=1e-4, atol=1e-5)
