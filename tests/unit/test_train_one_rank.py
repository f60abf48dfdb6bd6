"""The one-rank trainer step without FSDP, the clip factor folded into fused AdamW, and the DSpark
labels taken from the loss's own target logits: each held to the step it replaces (CPU)."""

import copy

import pytest
import torch

from hpctoolkit.models.dflash.layout import IGNORE_INDEX
from hpctoolkit.targets.resolve import resolve_target
from hpctoolkit.train.batch import collate
from hpctoolkit.train.build import build_trainer
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.fsdp import LocalMixedPrecision, build_mesh, init_distributed, shard_trainer
from hpctoolkit.train.optim import build_optimizer, clip_grad_norm
from hpctoolkit.train.step import forward_backward
from hpctoolkit.train.synthetic import SyntheticSamples

pytestmark = pytest.mark.timeout(240)
DRAFT = "recipes/draft_models/tiny_k3_dspark_mla.json"


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    c = init_distributed(0, 1, f"file://{tmp_path_factory.mktemp('rdzv') / 'init'}", "cpu")
    yield c
    c.close()


@pytest.fixture(scope="module")
def batches():
    src = SyntheticSamples(
        num_samples=4, vocab_size=512, hidden_size=128, num_aux=3, lengths=[40, 33], seed=6
    )
    return [
        collate([src.sample(2 * i + j) for j in range(2)], max_seq_len=64, min_loss_tokens=14)
        for i in range(2)
    ]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _two_steps(ctx, cfg: TrainingConfig, batches, *, fsdp: bool):
    """Losses, first-step gradients and final parameters of two AdamW steps (same-seed build)."""
    torch.manual_seed(0)
    tr = build_trainer(DRAFT, resolve_target("builtin:tiny-qwen3"), cfg)
    shard_trainer(tr, build_mesh(ctx, cfg.fsdp_mode), cfg, fsdp_on_one_rank=fsdp)
    opt, sched = build_optimizer(tr, cfg)
    losses, grads = [], {}
    dtype = torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32
    for step, batch in enumerate(batches):
        parts = forward_backward(tr, batch.to(ctx.device, dtype), step, ctx)
        losses.append(float(parts.numerator.detach()) / float(parts.denominator))
        if step == 0:
            grads = {n: _full(p.grad).clone() for n, p in tr.named_parameters() if p.grad is not None}
        clip_grad_norm(tr, cfg.grad_clip, opt)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    params = {n: _full(p.detach()).clone() for n, p in tr.named_parameters()}
    return losses, grads, params, tr


@pytest.mark.parametrize(("precision", "ac"), [("bf16", 0), ("bf16", 2), ("fp32", 0)])
def test_one_rank_without_fsdp_is_the_fsdp_step_bit_for_bit(ctx, batches, precision, ac):
    """`shard_trainer` on one rank skips FSDP2 (bf16: `LocalMixedPrecision`): the same losses,
    gradients and updated parameters as FSDP2 on that rank, bit for bit, with and without
    activation checkpointing; parameters and gradients stay fp32 under their own names."""
    cfg = TrainingConfig(num_anchors=4, mixed_precision=precision, activation_checkpoint_layers=ac, lr=1e-3)
    ref = _two_steps(ctx, cfg, batches, fsdp=True)
    got = _two_steps(ctx, cfg, batches, fsdp=False)
    tr = got[3]
    assert isinstance(getattr(tr, "_local_mixed_precision", None), LocalMixedPrecision) == (
        precision == "bf16"
    )
    assert got[0] == ref[0]
    assert got[1].keys() == ref[1].keys() and any(".layers.1." in n for n in ref[1])
    for name, g in ref[1].items():
        assert got[1][name].dtype == torch.float32
        torch.testing.assert_close(got[1][name], g, rtol=0, atol=0, msg=name)
    assert got[2].keys() == ref[2].keys()
    for name, p in ref[2].items():
        torch.testing.assert_close(got[2][name], p, rtol=0, atol=0, msg=name)
    trainable = [p for p in tr.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 and p.grad is None for p in trainable)


def test_a_forward_without_autograd_leaves_the_fp32_parameters_in_place(ctx, batches):
    cfg = TrainingConfig(num_anchors=4, mixed_precision="bf16")
    tr = build_trainer(DRAFT, resolve_target("builtin:tiny-qwen3"), cfg)
    shard_trainer(tr, build_mesh(ctx, cfg.fsdp_mode), cfg)
    before = dict(tr.named_parameters())
    with torch.no_grad():
        tr.run(batches[0], 0)
    assert dict(tr.named_parameters()) == before
    assert all(p.dtype == torch.float32 for p in tr.parameters() if p.requires_grad)
    parts = tr.run(batches[0], 0)  # with autograd: the bf16 twins until backward ends
    assert any(p.dtype == torch.bfloat16 for p in tr.parameters() if p.requires_grad)
    parts.numerator.backward()
    assert dict(tr.named_parameters()) == before
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in tr.draft.layers.parameters())


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])
def test_clip_factor_folded_into_fused_adamw_matches_clip_then_step(max_norm):
    """Fused AdamW dividing by the clip factor (`grad_scale`) against `clip_grad_norm_` then the
    same step: one rounding apart when clipping (max_norm 1e-3), identical when not (1e3)."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=g)
    cfg = TrainingConfig(lr=1e-2, weight_decay=0.1)
    arms = {}
    for arm in ("clip_then_step", "folded"):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(
            m.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95), fused=True
        )
        opt.register_step_post_hook(lambda o, args, kwargs: setattr(o, "grad_scale", None))
        norms = []
        for step in range(3):
            for p in m.parameters():
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)) * (step + 1)
            norms.append(clip_grad_norm(m, max_norm, opt if arm == "folded" else None))
            opt.step()
            assert getattr(opt, "grad_scale", None) is None
        arms[arm] = (torch.stack(norms), [p.detach().clone() for p in m.parameters()])
    torch.testing.assert_close(arms["folded"][0], arms["clip_then_step"][0], rtol=0, atol=0)
    tol = {"rtol": 1e-6, "atol": 1e-7} if max_norm < 1 else {"rtol": 0, "atol": 0}
    for a, b in zip(arms["folded"][1], arms["clip_then_step"][1], strict=True):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("draft", [DRAFT, "recipes/draft_models/tiny_dflash.json"])
def test_labels_from_the_loss_target_logits_match_precomputed_labels(batches, draft):
    """`label_source: target`: the DSpark and DFlash trainers run no target-head pass of their own
    for labels (`block_targets`); the loss takes each supervised slot's label from the target
    logits it forms at the scored slots anyway. Same loss, statistics and gradients as labels
    precomputed by a separate pass (as the trainers did before)."""
    cfg = TrainingConfig(num_anchors=4)
    torch.manual_seed(0)
    tr = build_trainer(draft, resolve_target("builtin:tiny-qwen3"), cfg).double()
    batch = batches[0]
    step = dict(tr.step_inputs(batch, 0).items())
    args = (batch.input_ids_BS, batch.last_BSH.double(), batch.loss_mask_BS())
    calls = []
    head_logits = tr.target_logits

    def counting(rows, prenorm):
        calls.append(rows.shape[0])
        return head_logits(rows, prenorm)

    tr.target_logits = counting  # type: ignore[method-assign]
    parts = tr.run(batch.to("cpu", torch.float64), 0)
    parts.numerator.backward()
    got = (parts, {n: p.grad.clone() for n, p in tr.named_parameters() if p.grad is not None})
    n_scored = step["anchors_BN"].numel() * (tr.block_size - 1)
    assert sum(calls) == n_scored  # the loss's rows only: no pass over every slot for labels
    tr.zero_grad(set_to_none=True)

    # The reference: labels from a separate target-head pass, as before.
    from hpctoolkit.models.dflash.loss import dflash_decay_gamma, dflash_loss
    from hpctoolkit.models.dspark.loss import dspark_loss

    layout, rows_BTH, marks_BT = tr.block_targets(*args, step["anchors_BN"], step["anchor_ok_BN"])
    with torch.no_grad():
        tgt_BT = head_logits(rows_BTH.flatten(0, 1), batch.last_prenorm).argmax(-1).view(marks_BT.shape)
    labels_BT = tgt_BT.masked_fill(marks_BT == IGNORE_INDEX, IGNORE_INDEX)
    assert (labels_BT != IGNORE_INDEX).any()
    out = tr.draft(batch.context_BSC.double(), batch.input_ids_BS, layout)
    if tr.family == "dflash":
        ref = dflash_loss(
            out.hidden_BTH,
            tr.draft.lm_head.weight,
            lambda r: head_logits(r, batch.last_prenorm),
            rows_BTH,
            labels_BT,
            step["anchor_ok_BN"],
            block_size=tr.block_size,
            gamma=dflash_decay_gamma(tr.block_size, tr.draft.config.decay_gamma),
        )
    else:
        ref = dspark_loss(
            out.hidden_BTH,
            out.markov_BTR.to(out.hidden_BTH.dtype),
            tr.draft.lm_head.weight,
            tr.draft.markov_head.markov_w2.weight,
            out.confidence_BT,
            lambda r: head_logits(r, batch.last_prenorm),
            rows_BTH,
            labels_BT,
            step["anchor_ok_BN"],
            block_size=tr.block_size,
        )
    ref.numerator.backward()
    torch.testing.assert_close(got[0].numerator, ref.numerator, rtol=1e-12, atol=0)
    torch.testing.assert_close(got[0].stats_vector(), ref.stats_vector(), rtol=1e-12, atol=0)
    for name, p in tr.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[1][name], p.grad, rtol=1e-10, atol=1e-14, msg=name)
