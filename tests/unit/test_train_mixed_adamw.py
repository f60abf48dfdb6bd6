"""`MixedAdamW` (one rank, bf16 gradients in, bf16 weights out) held to `torch.optim.AdamW` on the
CPU: its arithmetic (the torch reference of the Triton kernel), and the whole one-rank step
through `LocalMixedPrecision`. The kernel itself runs in `tests/gpu/test_train_gpu.py`."""

import pytest
import torch

from hpctoolkit.targets.resolve import resolve_target
from hpctoolkit.train.batch import collate
from hpctoolkit.train.build import build_trainer
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.fsdp import build_mesh, init_distributed, shard_trainer
from hpctoolkit.train.mixed_adamw import MixedAdamW, reference_step_
from hpctoolkit.train.optim import build_optimizer, clip_grad_norm
from hpctoolkit.train.step import forward_backward
from hpctoolkit.train.synthetic import SyntheticSamples

pytestmark = pytest.mark.timeout(240)
DRAFT = "recipes/draft_models/tiny_k3_dspark_mla.json"


@pytest.mark.parametrize("scale", [None, 3.0])
def test_the_kernels_arithmetic_is_adamws(scale):
    """Three updates by `reference_step_` against `torch.optim.AdamW(fused=True)` on the fp32
    upcast of the same bf16 gradients, weight decay and the clip divisor included: equal to fp32
    rounding (the moments to a millionth of their largest element)."""
    g = torch.Generator().manual_seed(1)
    p0 = torch.randn(4099, generator=g)
    grads = [(torch.randn(4099, generator=g) * 10**-i).to(torch.bfloat16) for i in range(3)]
    ref = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    p, m, v = p0.clone(), torch.zeros(4099), torch.zeros(4099)
    twin, step = torch.empty(4099, dtype=torch.bfloat16), torch.zeros(())
    for grad in grads:
        ref.grad = grad.float() / (scale or 1.0)
        opt.step()
        step += 1
        reference_step_(
            p, grad, m, v, twin, step, None if scale is None else torch.tensor(scale),
            lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
        )  # fmt: skip
        torch.testing.assert_close(p, ref.detach(), rtol=2e-6, atol=1e-7)
        for got, want in ((m, opt.state[ref]["exp_avg"]), (v, opt.state[ref]["exp_avg_sq"])):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
        assert torch.equal(twin, p.to(torch.bfloat16))


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    c = init_distributed(0, 1, f"file://{tmp_path_factory.mktemp('rdzv') / 'init'}", "cpu")
    yield c
    c.close()


def _steps(ctx, batches, *, mixed: bool):
    cfg = TrainingConfig(
        num_anchors=4, mixed_precision="bf16", lr=1e-3, weight_decay=0.01, grad_clip=0.05, warmup_steps=0
    )
    torch.manual_seed(0)
    tr = build_trainer(DRAFT, resolve_target("builtin:tiny-qwen3"), cfg)
    shard_trainer(tr, build_mesh(ctx, cfg.fsdp_mode), cfg)
    if mixed:  # build_optimizer picks it on CUDA with triton; the CPU runs the kernel's reference
        opt = MixedAdamW([p for p in tr.parameters() if p.requires_grad], tr._local_mixed_precision,
                         lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))  # fmt: skip
    else:
        opt, _ = build_optimizer(tr, cfg)
    init = {n: p.detach().clone() for n, p in tr.named_parameters() if p.requires_grad}
    losses, norms = [], []
    for step, batch in enumerate(batches):
        parts = forward_backward(tr, batch.to(ctx.device, torch.bfloat16), step, ctx)
        losses.append(float(parts.numerator.detach()) / float(parts.denominator))
        norms.append(float(clip_grad_norm(tr, cfg.grad_clip, opt)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return tr, opt, losses, norms, init


def test_the_one_rank_step_with_mixed_adamw_is_the_plain_one(ctx):
    """Through `LocalMixedPrecision`, the gradient clipped: MixedAdamW, reading the kept bf16
    gradients and writing the twins, against the plain path (fp32 `.grad`, AdamW, the twins cast
    before each forward). After one step every weight equal to its fp32 rounding (a weight-decay
    -only update, `p - lr*wd*p` against `p * (1 - lr*wd)`, is one rounding of `p` apart), and the
    twins the new weights in bf16; over three steps the same gradient norms and losses (the
    rounding moves later gradients a little); the optimizer state is AdamW's, key for key."""
    src = SyntheticSamples(
        num_samples=6, vocab_size=512, hidden_size=128, num_aux=3, lengths=[40, 33], seed=6
    )
    batches = [
        collate([src.sample(2 * i + j) for j in range(2)], max_seq_len=64, min_loss_tokens=14)
        for i in range(3)
    ]
    tr_p, _, _, norms_p, init = _steps(ctx, batches[:1], mixed=False)
    tr_m, _, _, norms_m, _ = _steps(ctx, batches[:1], mixed=True)
    assert norms_m == pytest.approx(norms_p, rel=1e-6) and norms_p[0] > 0.05  # clipped
    got = dict(tr_m.named_parameters())
    for name, p in tr_p.named_parameters():
        torch.testing.assert_close(got[name].detach(), p.detach(), rtol=4e-7, atol=1e-9, msg=name)
        if p.requires_grad:
            assert not torch.equal(p.detach(), init[name]), name
    lmp = tr_m._local_mixed_precision
    assert lmp.twins_current and not lmp.held and all(t.grad is None for _, t in lmp.pairs)
    for p, twin in lmp.pairs:
        assert torch.equal(twin, p.detach().to(torch.bfloat16))

    _, opt_p, losses_p, norms_p, _ = _steps(ctx, batches, mixed=False)
    _, opt_m, losses_m, norms_m, _ = _steps(ctx, batches, mixed=True)
    assert losses_m[0] == losses_p[0]
    # Later steps differ by bf16 roundings (the twins of weights one fp32 rounding apart may round
    # differently): a few bf16 ulps (2^-8 = 3.9e-3). Measured on a 2-core EPYC with AVX512-BF16
    # (2026-12-04): the third gradient norm 3.3e-3 apart, the losses within 1e-3.
    assert losses_m == pytest.approx(losses_p, rel=1e-3) and norms_m == pytest.approx(norms_p, rel=1e-2)
    sd_p, sd_m = opt_p.state_dict(), opt_m.state_dict()
    assert sd_m["state"].keys() == sd_p["state"].keys()
    for k, s in sd_p["state"].items():
        assert {n: (t.shape, t.dtype) for n, t in sd_m["state"][k].items()} == {
            n: (t.shape, t.dtype) for n, t in s.items()
        }
        assert float(sd_m["state"][k]["step"]) == float(s["step"]) == 3


def test_a_checkpoint_moves_between_mixed_adamw_and_a_fresh_one(ctx, tmp_path):
    """Two steps with MixedAdamW, saved through `Checkpointer` (Distributed Checkpoint), loaded
    into a fresh trainer and MixedAdamW (DCP initialises an empty optimizer's state by a zero-lr
    step on fp32 zero gradients: AdamW's own step), then one more step each: the same weights,
    so the moments and step counts came back and the twins were re-cast from the loaded weights
    (the load lands on a trainer that has stepped: its twins were current, and are not after)."""
    from hpctoolkit.train.checkpoint import Checkpointer

    src = SyntheticSamples(
        num_samples=6, vocab_size=512, hidden_size=128, num_aux=3, lengths=[40, 33], seed=6
    )
    batches = [
        collate([src.sample(2 * i + j) for j in range(2)], max_seq_len=64, min_loss_tokens=14)
        for i in range(3)
    ]
    cfg = TrainingConfig(num_anchors=4, mixed_precision="bf16", lr=1e-3, grad_clip=0.05, warmup_steps=0)

    def build():
        torch.manual_seed(0)
        tr = build_trainer(DRAFT, resolve_target("builtin:tiny-qwen3"), cfg)
        shard_trainer(tr, build_mesh(ctx, cfg.fsdp_mode), cfg)
        opt = MixedAdamW([p for p in tr.parameters() if p.requires_grad], tr._local_mixed_precision,
                         lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))  # fmt: skip
        return tr, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    def step(tr, opt, batch, i):
        forward_backward(tr, batch.to(ctx.device, torch.bfloat16), i, ctx)
        clip_grad_norm(tr, cfg.grad_clip, opt)
        opt.step()
        opt.zero_grad(set_to_none=True)

    tr, opt, sched = build()
    for i in range(2):
        step(tr, opt, batches[i], i)
    ckpt = Checkpointer(tmp_path, keep=2, ctx=ctx)
    ckpt.save(2, tr, opt, sched, samples_consumed={"epoch": 0, "offset": 0}, meta={})
    tr2, opt2, sched2 = build()
    step(tr2, opt2, batches[0], 0)  # weights and twins that the load must replace
    assert tr2._local_mixed_precision.twins_current
    ckpt.load(ckpt.latest(), tr2, opt2, sched2)
    assert not tr2._local_mixed_precision.twins_current
    step(tr, opt, batches[2], 2)
    step(tr2, opt2, batches[2], 2)
    got = dict(tr2.named_parameters())
    for name, p in tr.named_parameters():
        assert torch.equal(got[name].detach(), p.detach()), name
    assert float(opt2.state_dict()["state"][0]["step"]) == 3


def test_the_optimizer_switch(ctx):
    """`training.optimizer`: `auto` and `adamw` give torch's AdamW where `MixedAdamW` cannot run
    (here: the CPU); `mixed_adamw` there is refused in one line naming the key and the reason."""
    from hpctoolkit.errors import ConfigError

    cfg = TrainingConfig(num_anchors=4, mixed_precision="bf16")
    tr = build_trainer(DRAFT, resolve_target("builtin:tiny-qwen3"), cfg)
    shard_trainer(tr, build_mesh(ctx, cfg.fsdp_mode), cfg)
    for choice in ("auto", "adamw"):
        cfg.optimizer = choice
        opt, _ = build_optimizer(tr, cfg)
        assert type(opt) is torch.optim.AdamW, choice
    cfg.optimizer = "mixed_adamw"
    with pytest.raises(
        ConfigError, match=r"^training.optimizer: mixed_adamw cannot run here: the parameters are not on CUDA"
    ):
        build_optimizer(tr, cfg)
