"""Shared layers: RMSNorm, rotary embeddings (YaRN base and mscale), attention backends, fused CE."""

import math
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.attention import GQAAttention, causal_mask, check_gqa_heads
from hpctoolkit.models.common.fused_ce import fused_linear_cross_entropy, reference_cross_entropy
from hpctoolkit.models.common.mla import MLAAttention
from hpctoolkit.models.common.norm import RMSNorm
from hpctoolkit.models.common.rope import (
    RopeSpec,
    RotaryEmbedding,
    apply_rotary,
    compute_inv_freq,
    rotate_interleaved,
    yarn_get_mscale,
)
from hpctoolkit.models.dflash.config import DFlashConfig
from hpctoolkit.models.dflash.layout import block_attention_mask
from hpctoolkit.models.registry import load_draft_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "draft_models"
K3_RECIPE = RECIPES / "kimi_k3_dspark_mla.json"
TINY_K3 = RECIPES / "tiny_k3_dspark_mla.json"


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-6)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    x32 = x.float()
    ref = norm.weight * (x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(norm(x), ref)


def test_yarn_mscale_values():
    assert yarn_get_mscale(1.0) == 1.0
    assert yarn_get_mscale(0.5, 3.0) == 1.0
    assert yarn_get_mscale(32.0, 1.0) == pytest.approx(0.1 * math.log(32.0) + 1.0)
    spec = RopeSpec(
        "yarn", 50000.0, factor=32.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
    )
    # DeepSeek: cos/sin untouched when mscale == mscale_all_dim; the softmax scale carries mscale**2.
    assert spec.cos_sin_scale == pytest.approx(1.0)
    assert spec.softmax_scale_factor == pytest.approx((0.1 * math.log(32.0) + 1.0) ** 2)
    skewed = RopeSpec(
        "yarn", 50000.0, factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=1.0
    )
    assert skewed.cos_sin_scale == pytest.approx(yarn_get_mscale(40.0, 0.707) / yarn_get_mscale(40.0, 1.0))
    plain = RopeSpec("yarn", 10000.0, factor=4.0, original_max_position_embeddings=512)
    assert plain.cos_sin_scale == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert plain.softmax_scale_factor == 1.0


def test_k3_yarn_inv_freq_uses_configured_base_not_10000():
    config = load_draft_config(K3_RECIPE)
    assert config.rope_theta == 50000.0
    with torch.device("meta"):
        from hpctoolkit.models.registry import build_draft_model

        model = build_draft_model(config)
    rotary = model.rotary_emb
    assert rotary.base == 50000.0
    params = dict(config.rope_parameters)

    def transformers_reference(theta: float) -> torch.Tensor:
        ref_cfg = DeepseekV3Config(
            hidden_size=128,
            num_attention_heads=4,
            qk_rope_head_dim=config.qk_rope_head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rope_parameters={**params, "rope_theta": theta},
        )
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](ref_cfg, "cpu")
        assert attention_factor == pytest.approx(rotary.spec.cos_sin_scale)
        return inv_freq

    at_config = transformers_reference(50000.0)
    at_10k = transformers_reference(10000.0)
    torch.testing.assert_close(rotary.inv_freq, at_config, rtol=1e-6, atol=1e-9)
    assert not torch.allclose(rotary.inv_freq, at_10k, rtol=1e-3)
    # And the MLA softmax scale carries YaRN's mscale**2.
    attn = model.layers[0].self_attn
    expected = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5 * yarn_get_mscale(32.0, 1.0) ** 2
    assert attn.softmax_scale == pytest.approx(expected)


def test_default_and_llama3_inv_freq():
    spec = RopeSpec("default", 1000000.0)
    torch.testing.assert_close(compute_inv_freq(spec, 8), 1.0 / 1000000.0 ** (torch.arange(0, 8, 2) / 8))
    llama = RopeSpec("llama3", 500000.0, factor=8.0, original_max_position_embeddings=8192)
    inv = compute_inv_freq(llama, 128)
    base = compute_inv_freq(RopeSpec("default", 500000.0), 128)
    assert torch.equal(inv[:4], base[:4])  # high frequencies kept
    torch.testing.assert_close(inv[-1], base[-1] / 8.0)  # low frequencies divided by factor


def test_scaled_rope_without_its_original_length_is_a_config_error():
    # DraftConfig fills it in (transformers does); a bare config reaching RopeSpec must not
    # fail with int(None).
    class Bare:
        def __init__(self) -> None:
            self.rope_theta = 10000.0
            self.rope_parameters = {"rope_type": "llama3", "factor": 8.0}

    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        RopeSpec.from_config(Bare())
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        compute_inv_freq(RopeSpec("yarn", 10000.0, factor=4.0), 8)


def test_interleaved_rotation_rotates_adjacent_pairs():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(rotate_interleaved(x), torch.tensor([-2.0, 1.0, -4.0, 3.0]))
    rot = RotaryEmbedding(4, RopeSpec("default", 10000.0), interleaved=True)
    pos = torch.tensor([[3]])
    cos, sin = rot(pos)
    out = apply_rotary(x.view(1, 1, 1, 4), cos, sin, interleaved=True).flatten()
    freqs = 3 * compute_inv_freq(RopeSpec("default", 10000.0), 4)
    for i, f in enumerate(freqs.tolist()):
        a, b = x[2 * i].item(), x[2 * i + 1].item()
        assert out[2 * i].item() == pytest.approx(a * math.cos(f) - b * math.sin(f), abs=1e-6)
        assert out[2 * i + 1].item() == pytest.approx(b * math.cos(f) + a * math.sin(f), abs=1e-6)


def _set_backend(module: torch.nn.Module, backend: str) -> None:
    for m in module.modules():
        if hasattr(m, "backend"):
            m.backend = backend


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_flex_agrees_with_sdpa_on_block_mask(kind):
    torch.manual_seed(0)
    config = load_draft_config(TINY_K3)
    if kind == "gqa":
        attn = GQAAttention(hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6)
        rot = RotaryEmbedding(16, RopeSpec("default", 10000.0))
        width = 64
    else:
        attn = MLAAttention.from_config(config, 0)
        rot = RotaryEmbedding(config.qk_rope_head_dim, RopeSpec.from_config(config), interleaved=True)
        width = config.hidden_size
    anchors = torch.tensor([[3, 9, 15], [1, 4, 20]])
    block, ctx_len = 4, 24
    mask = block_attention_mask(anchors, block, ctx_len)
    x = torch.randn(2, 12, width)
    kv = torch.cat([torch.randn(2, ctx_len, width), x], dim=1)
    q_pos = (anchors.unsqueeze(-1) + torch.arange(block)).flatten(1)
    k_pos = torch.cat([torch.arange(ctx_len).expand(2, -1), q_pos], dim=1)
    outs = {}
    # Forward only: FlexAttention has no CPU backward; the H200 benchmark trains through it.
    with torch.no_grad():
        for backend in ("sdpa", "flex"):
            _set_backend(attn, backend)
            outs[backend] = attn(x, kv, rot(q_pos), rot(k_pos), mask)
    torch.testing.assert_close(outs["flex"], outs["sdpa"], rtol=1e-4, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_agrees_with_sdpa_causal():
    torch.manual_seed(0)
    attn = GQAAttention(hidden_size=32, num_heads=4, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-6)
    rot = RotaryEmbedding(8, RopeSpec("default", 10000.0))
    x = torch.randn(2, 10, 32)
    rope = rot(torch.arange(10).expand(2, -1))
    with torch.no_grad():
        ref = attn(x, x, rope, rope, causal_mask(2, 10, x.device))
        _set_backend(attn, "flex")
        got = attn(x, x, rope, rope, causal_mask(2, 10, x.device))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_extra", [False, True])
def test_fused_cross_entropy_matches_materialised_logits(with_extra):
    torch.manual_seed(0)
    n, h, r, v = 29, 12, 4, 40
    hidden = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, dtype=torch.float64)  # frozen, like lm_head
    extra = torch.randn(n, r, dtype=torch.float64, requires_grad=True) if with_extra else None
    w_extra = torch.randn(v, r, dtype=torch.float64, requires_grad=True) if with_extra else None
    labels = torch.randint(0, v, (n,))
    labels[::4] = -100
    loss, hit = fused_linear_cross_entropy(
        hidden, weight, labels, extra_NR=extra, extra_weight_VR=w_extra, chunk_size=8
    )
    (3 * loss).backward()
    leaves = [hidden] + ([extra, w_extra] if with_extra else [])
    got = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    logits = hidden @ weight.t() + (extra @ w_extra.t() if with_extra else 0)
    ref = reference_cross_entropy(logits, labels)
    (3 * ref).backward()
    torch.testing.assert_close(loss.double(), ref.double(), rtol=1e-6, atol=1e-6)
    for g, t in zip(got, leaves, strict=True):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-7)
    assert torch.equal(hit, logits.argmax(-1) == labels)


def test_fused_cross_entropy_never_computes_ignored_rows():
    """Ignored rows are dropped before the GEMMs: a NaN there reaches neither loss nor gradients."""
    torch.manual_seed(0)
    hidden = torch.randn(10, 6, dtype=torch.float64)
    labels = torch.randint(0, 9, (10,))
    labels[[0, 7]] = -100
    poisoned = hidden.clone()
    poisoned[[0, 7]] = float("nan")
    weight = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    grads = []
    for rows in (hidden, poisoned):
        h = rows.clone().requires_grad_()
        loss, _ = fused_linear_cross_entropy(h, weight, labels, chunk_size=4)
        loss.backward()
        grads.append((loss.detach(), h.grad, weight.grad.clone()))
        weight.grad = None
    (l0, gh0, gw0), (l1, gh1, gw1) = grads
    assert torch.isfinite(l1) and torch.equal(l0, l1) and torch.equal(gw0, gw1)
    assert torch.equal(gh0, gh1) and not gh1[[0, 7]].any()


@pytest.mark.parametrize(
    "shape", [(2, [[3, 9, 15], [1, 4, 20]], 4, 24), (1, [[0, 130, 300]], 7, 333), (3, None, 0, 0)]
)
def test_the_block_mask_built_in_bands_is_create_block_masks(shape, monkeypatch):
    """The BlockMask built a band of query blocks at a time (no torch.compile) has the same
    partial and full blocks as `create_block_mask`, for the DSpark mask at shapes that are not
    multiples of the block and for a causal mask, also with bands smaller than the mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    from hpctoolkit.models.common import block_mask as bm

    batch, anchors, block, ctx_len = shape
    if anchors is None:
        mask = causal_mask(batch, 517, torch.device("cpu"))
    else:
        mask = block_attention_mask(torch.tensor(anchors), block, ctx_len)
    ref = create_block_mask(mask.mask_mod, mask.batch, None, mask.q_len, mask.kv_len, device="cpu")
    for band_pairs in (bm.BAND_PAIRS, 1):  # one band; one query block per band
        monkeypatch.setattr(bm, "BAND_PAIRS", band_pairs)
        got = bm.build_block_mask(mask.mask_mod, mask.batch, mask.q_len, mask.kv_len, torch.device("cpu"))
        assert got.seq_lengths == ref.seq_lengths
        for a, b in (
            (got.kv_num_blocks, ref.kv_num_blocks),
            (got.full_kv_num_blocks, ref.full_kv_num_blocks),
        ):
            assert torch.equal(a.expand_as(b), b)
        torch.testing.assert_close(got.to_dense(), ref.to_dense(), rtol=0, atol=0)


def test_query_heads_must_share_the_kv_heads_evenly():
    check_gqa_heads(8, 2)
    check_gqa_heads(4, 4)
    for heads, kv in [(6, 4), (4, 0), (4, 8)]:
        with pytest.raises(
            ConfigError,
            match=rf"^num_attention_heads={heads} must be a multiple of num_key_value_heads={kv}$",
        ):
            check_gqa_heads(heads, kv)
    # Both homes of the rule ask it: the config at load, the layer when built directly.
    with pytest.raises(ConfigError, match="must be a multiple"):
        GQAAttention(hidden_size=48, num_heads=6, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-6)
    with pytest.raises(ConfigError, match="must be a multiple"):
        DFlashConfig(num_attention_heads=6, num_key_value_heads=4)
