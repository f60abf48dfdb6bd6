"""DFlash/DSpark block layout, dual-source attention semantics, fc_norm and Eagle3 basics."""

import json
from pathlib import Path

import pytest
import torch

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.dflash.config import DFlashConfig
from hpctoolkit.models.dflash.layout import IGNORE_INDEX, make_block_layout, sample_anchors
from hpctoolkit.models.dflash.loss import block_cross_entropy
from hpctoolkit.models.registry import build_draft_model, load_draft_config

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "draft_models"


def test_layout_positions_labels_and_inputs():
    ids = torch.arange(100, 120).unsqueeze(0)  # token == 100 + position
    layout = make_block_layout(torch.tensor([[3, 10]]), block_size=4, context_len=20)
    assert layout.q_position_ids().tolist() == [[3, 4, 5, 6, 10, 11, 12, 13]]
    assert layout.k_position_ids().tolist() == [[*range(20), 3, 4, 5, 6, 10, 11, 12, 13]]
    assert layout.block_input_ids(ids, mask_token_id=7).tolist() == [[103, 7, 7, 7, 110, 7, 7, 7]]
    assert layout.labels(ids).tolist() == [[IGNORE_INDEX, 104, 105, 106, IGNORE_INDEX, 111, 112, 113]]
    assert layout.prev_token_ids(ids).tolist() == [[102, 103, 104, 105, 109, 110, 111, 112]]
    late = make_block_layout(torch.tensor([[18]]), block_size=4, context_len=20)
    assert late.labels(ids).tolist() == [[IGNORE_INDEX, 119, IGNORE_INDEX, IGNORE_INDEX]]


def test_block_mask_sees_context_before_anchor_and_own_block_only():
    layout = make_block_layout(torch.tensor([[3, 10]]), block_size=2, context_len=12)
    dense = layout.attention_mask().dense_B1QK()[0, 0]
    for q in range(4):
        anchor = 3 if q < 2 else 10
        own = {12, 13} if q < 2 else {14, 15}
        visible = {int(k) for k in dense[q].nonzero()}
        assert visible == set(range(anchor)) | own


def test_sample_anchors_leave_room_for_a_block():
    mask = torch.ones(3, 30)
    mask[2, 20:] = 0
    anchors, valid = sample_anchors(
        mask, num_blocks=5, block_size=7, generator=torch.Generator().manual_seed(0)
    )
    assert anchors.shape == valid.shape == (3, 5)
    assert bool(valid.all())
    assert int(anchors.min()) >= 1 and int(anchors.max()) <= 30 - 7
    assert int(anchors[2].max()) < 20
    assert all(len(set(row.tolist())) == 5 for row in anchors)
    short, ok = sample_anchors(torch.ones(1, 10), num_blocks=6, block_size=7)
    assert ok.sum() == 3  # only positions 1..3 can hold a whole block
    layout = make_block_layout(short, 7, 10, valid_BN=ok)
    labels = layout.labels(torch.arange(10).unsqueeze(0)).view(6, 7)
    assert bool((labels[~ok[0]] == IGNORE_INDEX).all())
    assert bool((labels[ok[0]][:, 1:3] != IGNORE_INDEX).all())


@pytest.mark.parametrize("recipe", ["tiny_dflash.json", "tiny_dspark.json", "tiny_k3_dspark_mla.json"])
def test_blocks_are_isolated_and_only_see_context_before_their_anchor(recipe):
    torch.manual_seed(0)
    config = load_draft_config(RECIPES / recipe)
    model = build_draft_model(config).eval()
    S, bs = 30, config.block_size
    ids = torch.randint(0, config.vocab_size - 1, (1, S))
    ctx = torch.randn(1, S, config.num_target_layers * config.target_hidden_size)
    layout = make_block_layout(torch.tensor([[6, 15]]), bs, S)
    with torch.no_grad():
        base = model(ctx, ids, layout).hidden_BTH
        ctx2 = ctx.clone()
        ctx2[:, 6:] += 1.0  # everything at or after block 0's anchor
        moved = model(ctx2, ids, layout).hidden_BTH
        other = model(ctx, ids, make_block_layout(torch.tensor([[6, 20]]), bs, S)).hidden_BTH
    torch.testing.assert_close(moved[:, :bs], base[:, :bs])
    assert not torch.allclose(moved[:, bs:], base[:, bs:])
    torch.testing.assert_close(other[:, :bs], base[:, :bs])


def test_fc_norm_is_off_by_default_and_only_adds_its_own_names():
    data = json.loads((RECIPES / "tiny_dflash.json").read_text())
    data.pop("model_type")
    off = DFlashConfig(**data)
    on = DFlashConfig(**data, fc_norm=True)
    assert not off.fc_norm
    keys_off = set(build_draft_model(off, device="meta").state_dict())
    keys_on = set(build_draft_model(on, device="meta").state_dict())
    assert not any(k.startswith("fc_norm") for k in keys_off)
    assert keys_on - keys_off == {f"fc_norm.{i}.weight" for i in range(off.num_target_layers)}
    assert keys_off < keys_on
    # Unit-weight per-layer norms on unit-RMS chunks leave the projection's input unchanged.
    torch.manual_seed(0)
    m_off, m_on = build_draft_model(off), build_draft_model(on)
    m_on.load_state_dict(m_off.state_dict(), strict=False)
    ctx = torch.randn(1, 5, 3, off.target_hidden_size)
    ctx = (ctx / ctx.pow(2).mean(-1, keepdim=True).sqrt()).flatten(2)
    torch.testing.assert_close(m_on.project_context(ctx), m_off.project_context(ctx), rtol=1e-4, atol=1e-5)


def test_dflash_training_step_and_logits_api():
    torch.manual_seed(0)
    config = load_draft_config(RECIPES / "tiny_dflash.json")
    model = build_draft_model(config)
    ids = torch.randint(0, 500, (2, 24))
    ctx = torch.randn(2, 24, 3 * config.target_hidden_size)
    layout = make_block_layout(torch.tensor([[2, 9], [4, 15]]), config.block_size, 24)
    out = model(ctx, ids, layout, return_logits=True)
    assert out.logits_BTV.shape == (2, 8, config.draft_vocab_size)
    labels = layout.labels(ids)
    loss = block_cross_entropy(out.hidden_BTH, model.lm_head.weight, labels)
    ref = torch.nn.functional.cross_entropy(
        out.logits_BTV.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX
    )
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert model.fc.weight.grad is not None and model.layers[0].self_attn.k_norm.weight.grad is not None
    assert model.lm_head.weight.grad is None  # frozen target head


def test_config_errors_name_the_key():
    data = json.loads((RECIPES / "tiny_dflash.json").read_text())
    data.pop("model_type")
    with pytest.raises(ConfigError, match="target_layer_ids"):
        DFlashConfig(**(data | {"target_layer_ids": [3, 1]}))
    with pytest.raises(ConfigError, match="mask_token_id"):
        DFlashConfig(**(data | {"mask_token_id": None}))
    with pytest.raises(ConfigError, match="attention_backend"):
        DFlashConfig(**(data | {"attention_backend": "flash"}))
    nested = DFlashConfig(
        **{k: v for k, v in data.items() if k not in ("target_layer_ids", "mask_token_id")},
        dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 2]},
    )
    assert nested.mask_token_id == 5 and nested.target_layer_ids == [0, 2] and nested.num_target_layers == 2


def test_eagle3_forward_and_vocab_maps():
    torch.manual_seed(0)
    config = load_draft_config(RECIPES / "tiny_eagle3.json")
    model = build_draft_model(config)
    draft_ids = torch.arange(0, 512, 2)
    model.set_vocab_mapping(draft_ids)
    assert torch.equal(torch.arange(256) + model.d2t, draft_ids)
    assert int(model.t2d.sum()) == 256 and bool(model.t2d[draft_ids].all())
    aux = torch.randn(2, 9, 3 * config.target_hidden_size)
    ids = torch.randint(0, 512, (2, 9))
    out = model(aux, ids, return_logits=True)
    assert out.logits_BSV.shape == (2, 9, 256)
    step2 = model(None, ids, hidden_BSH=out.prenorm_BSH)  # test-time-training step
    step2.hidden_BSH.sum().backward()
    assert model.midlayer.self_attn.q_proj.weight.grad is not None
    assert not model.embed_tokens.weight.requires_grad
    # Causal: the first position cannot see the later ones.
    aux2 = aux.clone()
    aux2[:, 5:] += 1.0
    with torch.no_grad():
        a, b = model(aux, ids).hidden_BSH, model(aux2, ids).hidden_BSH
    torch.testing.assert_close(a[:, :5], b[:, :5])


def _ttt_unroll(model, hidden0, ids, steps, cache_cls):
    """The Eagle3 trainer's unroll (production `shift_left`), returning each step's prenorm."""
    from hpctoolkit.models.eagle3.trainer import shift_left

    B, S = ids.shape
    pos = torch.arange(S).expand(B, S)
    cache = cache_cls() if cache_cls else None
    hidden, outs = hidden0, []
    for i in range(steps):
        out = model(None, shift_left(ids, i + 1), pos + i, hidden_BSH=hidden, kv_cache=cache)
        outs.append(out.prenorm_BSH)
        hidden = out.prenorm_BSH
    return outs


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_eagle3_ttt_unroll_matches_serving_order(backend):
    """Step `i` at index `t` of the training unroll equals what the served drafter computes for
    position `t + i`: a causal forward over the context entries `0..t` (target states) followed by
    the drafted entries `1..i` (the draft's own outputs), in float64. The step-isolated unroll
    (no shared cache) does not, so the check is not vacuous."""
    from hpctoolkit.models.eagle3.model import KVCache

    torch.manual_seed(0)
    config = load_draft_config(RECIPES / "tiny_eagle3.json")
    model = build_draft_model(config).double()
    for m in model.modules():
        if hasattr(m, "backend"):
            m.backend = backend
    B, S, P = 2, 10, 4
    ids = torch.randint(0, config.vocab_size, (B, S))
    with torch.no_grad():
        hidden0 = model.project_aux(torch.randn(B, S, 3 * config.target_hidden_size, dtype=torch.float64))
        unrolled = _ttt_unroll(model, hidden0, ids, P, KVCache)
        isolated = _ttt_unroll(model, hidden0, ids, P, None)
        worst_isolated = 0.0
        for t in range(S - P):
            # Serving order: context entries 0..t carry (token k+1, target state k, position k).
            toks = [ids[:, k + 1] for k in range(t + 1)]
            hid = [hidden0[:, k] for k in range(t + 1)]
            poss = list(range(t + 1))
            prev = None
            for i in range(P):
                if i > 0:  # drafted entry i: (token t+1+i, previous draft output, position t+i)
                    toks.append(ids[:, t + 1 + i])
                    hid.append(prev)
                    poss.append(t + i)
                out = model(
                    None,
                    torch.stack(toks, dim=1),
                    torch.tensor(poss).expand(B, -1),
                    hidden_BSH=torch.stack(hid, dim=1),
                )
                prev = out.prenorm_BSH[:, -1]
                torch.testing.assert_close(unrolled[i][:, t], prev, rtol=0, atol=1e-10)
                worst_isolated = max(worst_isolated, float((isolated[i][:, t] - prev).abs().max()))
    assert worst_isolated > 1e-3
