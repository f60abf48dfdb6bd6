"""GPU checks of the trainer's own step (skipped without CUDA; run on the H200 machine).

    python -m pytest tests/gpu/test_train_gpu.py -q

The production path: `build_trainer`, `shard_trainer` (one rank: `LocalMixedPrecision`, compiled
decoder layers, FlexAttention), the fused DSpark loss, on the tiny K3 MLA draft.
"""

import dataclasses
import os
import time
from pathlib import Path

import pytest
import torch

from hpctoolkit.models.registry import load_draft_config
from hpctoolkit.train.batch import collate
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.fsdp import build_mesh, init_distributed, shard_trainer
from hpctoolkit.train.step import forward_backward
from hpctoolkit.train.synthetic import SyntheticSamples
from hpctoolkit.train.target_head import TargetHead
from hpctoolkit.train.trainers.build import build_trainer

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "draft_models"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def ctx(tmp_path_factory):
    c = init_distributed(0, 1, f"file://{tmp_path_factory.mktemp('rdzv') / 'init'}", "cuda")
    yield c
    c.close()


def _step(ctx, cfg: TrainingConfig, batch, backend: str = "flex"):
    """Loss and full gradients of one step on a freshly built (same-seed) trainer."""
    config = load_draft_config(RECIPES / "tiny_k3_dspark_mla.json")
    config.attention_backend = backend
    g = torch.Generator().manual_seed(0)
    V, H = config.vocab_size, config.hidden_size
    head = TargetHead((torch.randn(V, H, generator=g) * 0.5).to(torch.bfloat16), torch.ones(H), 1e-6)
    trainer = build_trainer(config, head, cfg, device=ctx.device)
    trainer.to(ctx.device)
    shard_trainer(trainer, build_mesh(ctx, cfg.fsdp_mode), cfg)
    parts = forward_backward(trainer, batch.to(ctx.device, torch.float32), 0, ctx)
    # One rank trains without FSDP (plain fp32 gradients); a DTensor would need `full_tensor`.
    grads = {
        n: getattr(p.grad, "full_tensor", lambda g=p.grad: g)().float()
        for n, p in trainer.named_parameters()
        if p.grad is not None
    }
    return float(parts.numerator.detach()) / float(parts.denominator), grads


@pytest.mark.parametrize(
    ("precision", "loss_rtol", "grad_rel"),
    [("fp32", 1e-5, 1e-5), ("bf16", 1e-3, 1e-2)],
)
def test_activation_checkpointing_gives_the_same_step(ctx, precision, loss_rtol, grad_rel):
    """All decoder layers recomputed in backward vs none: the same loss (to `loss_rtol`) and
    every gradient to `grad_rel` in relative Frobenius norm (compiled layers, flex, FSDP2)."""
    src = SyntheticSamples(
        num_samples=2, vocab_size=512, hidden_size=128, num_aux=3, lengths=[512, 400], seed=3
    )
    batch = collate([src.sample(i) for i in range(2)], max_seq_len=512, min_loss_tokens=14)
    common = {"num_anchors": 24, "device": "cuda", "mixed_precision": precision, "max_seq_len": 512}
    ref_loss, ref = _step(ctx, TrainingConfig(**common), batch)
    loss, got = _step(ctx, TrainingConfig(**common, activation_checkpoint_layers=2), batch)
    assert loss == pytest.approx(ref_loss, rel=loss_rtol)
    assert got.keys() == ref.keys() and "draft.layers.1.self_attn.q_a_proj.weight" in ref
    for name, g in ref.items():
        rel = float((got[name] - g).norm() / g.norm().clamp_min(1e-12))
        assert rel <= grad_rel, f"{name}: relative difference {rel:.2e} > {grad_rel}"


def test_the_compiled_gradient_cast_is_exact():
    """`fsdp.upcast` (one compiled kernel) gives `.to(float32)` bit for bit, odd sizes included."""
    from hpctoolkit.train.fsdp import upcast

    for shape in [(7,), (3, 5), (1537, 129), (2, 3, 4097)]:
        g = (torch.randn(shape, device="cuda") * 1e3).to(torch.bfloat16)
        got = upcast(g, torch.float32)
        assert got.dtype == torch.float32 and got.shape == g.shape
        assert torch.equal(got, g.to(torch.float32))


def _trainer(ctx, cfg: TrainingConfig, mixed: bool = True):
    config = load_draft_config(RECIPES / "tiny_k3_dspark_mla.json")
    g = torch.Generator().manual_seed(0)
    V, H = config.vocab_size, config.hidden_size
    head = TargetHead((torch.randn(V, H, generator=g) * 0.5).to(torch.bfloat16), torch.ones(H), 1e-6)
    torch.manual_seed(0)
    trainer = build_trainer(config, head, cfg, device=ctx.device)
    trainer.to(ctx.device)
    shard_trainer(trainer, build_mesh(ctx, cfg.fsdp_mode), cfg)
    from hpctoolkit.train.optim import build_optimizer

    return (
        trainer,
        *build_optimizer(trainer, dataclasses.replace(cfg, optimizer="mixed_adamw" if mixed else "adamw")),
    )


def _run_steps(ctx, cfg, batches, *, overlapped: bool, mixed: bool = True):
    """Statistics of each step and the final weights, stepping as the loop does or drained."""
    from hpctoolkit.train.mixed_adamw import MixedAdamW
    from hpctoolkit.train.step import DeviceFeeder, launch, one_ahead

    trainer, opt, sched = _trainer(ctx, cfg, mixed)
    assert isinstance(opt, MixedAdamW) == mixed
    feeder, stats = DeviceFeeder(ctx.device, torch.bfloat16), []
    if not overlapped:
        for step, b in enumerate(batches):
            res = launch(trainer, opt, sched, b.to(ctx.device, torch.bfloat16), step, ctx, cfg.grad_clip)
            stats.append(res.result().stats)
            torch.cuda.synchronize()
    else:
        launches = (
            launch(trainer, opt, sched, feeder.put(b), step, ctx, cfg.grad_clip)
            for step, b in enumerate(batches)
        )
        stats = [launched.result().stats for launched in one_ahead(launches)]
    return torch.stack(stats), {n: p.detach().clone() for n, p in trainer.named_parameters()}


def _max_diff(a, b) -> float:
    return _where_apart(a, b)[0]


def _where_apart(a, b) -> tuple[float, str]:
    """The largest difference between two runs and where it is: the first step whose statistics
    differ most (and which of them), or the parameter."""
    (sa, pa), (sb, pb) = a, b
    per_step = (sa.double() - sb.double()).abs()
    worst = [
        (
            float(per_step.max()),
            f"statistics, step {int(per_step.max(dim=1).values.argmax())}, "
            f"entry {int(per_step.max(dim=0).values.argmax())}: {sa.tolist()} against {sb.tolist()}",
        )
    ]
    worst += [(float((pa[n].double() - pb[n].double()).abs().max()), f"parameter {n}") for n in pa]
    return max(worst, key=lambda w: w[0])


# Repeats in one process (`gpu_node.sh` stage `flake` runs them after the vLLM engine tests, where
# the tier of 2026-12-06 saw this test fail once).
OVERLAP_REPEATS = int(os.environ.get("HPCTOOLKIT_OVERLAP_REPEATS", "1"))


@pytest.mark.parametrize("repeat", range(OVERLAP_REPEATS))
def test_overlapped_steps_train_as_drained_ones(ctx, repeat):
    """The training loop's steps (`step.launch`, page-locked batches moved on a copy stream, each
    step queued before the previous one's statistics are read) against the same steps drained one
    at a time with plain copies: the same statistics and weights after 8 steps over 4 distinct
    batches. Bit for bit where the drained run repeats itself bit for bit; otherwise (atomics in
    some backward kernels) no further apart than two drained runs are from each other, or 1e-5.
    A copy
    stream the compute stream did not wait for, or a buffer freed before its copy ran, trains on
    the wrong data and lands far outside that."""
    cfg = TrainingConfig(
        num_anchors=24, device="cuda", mixed_precision="bf16", max_seq_len=512, steps=8, warmup_steps=1
    )
    src = SyntheticSamples(
        num_samples=16, vocab_size=512, hidden_size=128, num_aux=3, lengths=[512, 400, 300], seed=5
    )
    batches = [
        collate(
            [src.sample(2 * i), src.sample(2 * i + 1)], max_seq_len=512, min_loss_tokens=14, pin_memory=True
        )
        for i in range(4)
    ] * 2
    drained = _run_steps(ctx, cfg, batches, overlapped=False)
    again = _run_steps(ctx, cfg, batches, overlapped=False)
    overlapped = _run_steps(ctx, cfg, batches, overlapped=True)
    noise = _max_diff(drained, again)
    gap, where = _where_apart(drained, overlapped)
    print(f"drained vs drained {noise:.3e}, drained vs overlapped {gap:.3e}")
    # Two drained runs are bit for bit equal in some calls and 1e-8..1e-6 apart in others (the
    # atomics), so an overlapped run that picked up that noise when the drained pair did not is
    # allowed 1e-5; wrong data moves the statistics by whole units.
    bound = max(2 * noise, 1e-5)
    # Where (a flaky failure in the tier of 2026-12-06, after the vLLM engine tests, passed alone,
    # in a smaller module run and beside a loaded GPU): which step and statistic, or parameter.
    assert gap <= bound, f"overlapped steps differ by {gap:.3e} ({where}); two drained runs by {noise:.3e}"


def test_the_mixed_adamw_kernel_is_fused_adamw():
    """The Triton kernel of `MixedAdamW` (bf16 gradient in, fp32 weight and moments, bf16 twin out)
    against `torch.optim.AdamW(fused=True)` on the fp32 upcast of the same gradients, three steps,
    weight decay and the clip divisor in: weights to 2e-6 relative or 5e-8 absolute (5e-6 of the
    learning rate: ATen's kernel does its arithmetic in double, this one in float, so the updates
    are a few fp32 roundings apart), moments to a millionth
    of their largest element, the twin the new weight in bf16 exactly. Odd sizes (block tails)."""
    from hpctoolkit.train.mixed_adamw import adamw_step_

    g = torch.Generator(device="cuda").manual_seed(0)
    sizes = [1, 2047, 2048 * 5 + 3, (1 << 20) + 17]
    p0 = [torch.randn(n, device="cuda", generator=g) for n in sizes]
    refs = [torch.nn.Parameter(p.clone()) for p in p0]
    opt = torch.optim.AdamW(refs, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95), fused=True)
    ours = [
        (p.clone(), torch.zeros_like(p), torch.zeros_like(p), torch.empty_like(p, dtype=torch.bfloat16))
        for p in p0
    ]
    step = torch.zeros((), device="cuda")
    for i in range(3):
        grads = [(torch.randn(n, device="cuda", generator=g) * 10.0**-i).to(torch.bfloat16) for n in sizes]
        scale = torch.tensor(1.0 + i, device="cuda")
        for r, gr in zip(refs, grads, strict=True):
            r.grad = gr.float()
        opt.grad_scale = scale
        opt.step()
        step += 1
        for (p, m, v, twin), gr in zip(ours, grads, strict=True):
            adamw_step_(
                p, gr, m, v, twin, step, scale, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1
            )
        for r, (p, m, v, twin) in zip(refs, ours, strict=True):
            st = opt.state[r]
            print(f"step {i}, {p.numel()} elements: weights {float((p - r).abs().max()):.2e} apart")
            torch.testing.assert_close(p, r.detach(), rtol=2e-6, atol=5e-8)
            for got, want in ((m, st["exp_avg"]), (v, st["exp_avg_sq"])):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
            assert torch.equal(twin, p.to(torch.bfloat16))


def test_the_step_with_mixed_adamw_trains_as_the_plain_one(ctx):
    """The trainer's CUDA step with `MixedAdamW` (what `build_optimizer` picks on one rank in
    bf16) against the plain path (fp32 gradients, fused AdamW, weight casts), 6 drained steps:
    the same first loss, then losses within 1e-3 and gradient norms within 1e-2 (one fp32
    rounding of the weights apart each step, which moves bf16 twins now and then)."""
    cfg = TrainingConfig(
        num_anchors=24, device="cuda", mixed_precision="bf16", max_seq_len=512, steps=6, warmup_steps=1
    )
    src = SyntheticSamples(
        num_samples=6, vocab_size=512, hidden_size=128, num_aux=3, lengths=[512, 400], seed=7
    )
    batches = [
        collate([src.sample(2 * i), src.sample(2 * i + 1)], max_seq_len=512, min_loss_tokens=14)
        for i in range(3)
    ] * 2
    mixed = _run_steps(ctx, cfg, batches, overlapped=False, mixed=True)
    plain = _run_steps(ctx, cfg, batches, overlapped=False, mixed=False)
    loss = lambda st: (st[:, 1] / st[:, 0]).tolist()  # noqa: E731
    print("mixed", loss(mixed[0]), "plain", loss(plain[0]))
    assert loss(mixed[0])[0] == loss(plain[0])[0]
    assert loss(mixed[0]) == pytest.approx(loss(plain[0]), rel=1e-3)


def test_a_step_is_queued_without_waiting_for_the_device(ctx):
    """The loop queues step n + 1 while step n runs: `launch` must not wait for the device. A
    kernel that spins for about a second is queued first; launching a step (anchors drawn on the
    host and moved, the batch moved on the copy stream, forward, backward, clipping, MixedAdamW)
    must return well before it ends. A pageable host-to-device copy (it waits for its stream to
    drain first), a `.item()` or a host scalar written into a device tensor would each wait out
    the spin: at K3 shapes they drained the queue twice a step (8 ms of idle device a step)."""
    from hpctoolkit.train.step import DeviceFeeder, launch

    cfg = TrainingConfig(
        num_anchors=24, device="cuda", mixed_precision="bf16", max_seq_len=512, steps=6, warmup_steps=1
    )
    src = SyntheticSamples(
        num_samples=8, vocab_size=512, hidden_size=128, num_aux=3, lengths=[512, 300], seed=3
    )
    batches = [
        collate(
            [src.sample(2 * i), src.sample(2 * i + 1)], max_seq_len=512, min_loss_tokens=14, pin_memory=True
        )
        for i in range(3)
    ]
    trainer, opt, sched = _trainer(ctx, cfg)
    feeder = DeviceFeeder(ctx.device, torch.bfloat16)
    for step in range(2):  # compile, allocate
        launch(trainer, opt, sched, feeder.put(batches[step]), step, ctx, cfg.grad_clip).result()
    torch.cuda.synchronize()
    spin = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spin[0].record()
    torch.cuda._sleep(2_000_000_000)  # about 1 s on an H200
    spin[1].record()
    t0 = time.monotonic()
    launched = launch(trainer, opt, sched, feeder.put(batches[2]), 2, ctx, cfg.grad_clip)
    host_s = time.monotonic() - t0
    launched.result()
    spin_s = spin[0].elapsed_time(spin[1]) / 1e3
    print(f"launch returned after {host_s * 1e3:.1f} ms; the spin queued before it ran {spin_s * 1e3:.0f} ms")
    assert spin_s > 0.5, "the spin kernel was too short to tell"
    assert host_s < 0.5 * spin_s, (
        f"launch waited for the device: {host_s:.3f} s against a {spin_s:.3f} s spin"
    )


@pytest.mark.parametrize("family", ["dflash", "dspark"])
def test_the_compiled_fused_block_loss_is_the_eager_one(family):
    """The fused block losses (`common.fused_rows`) with each chunk's elementwise work compiled
    (what CUDA runs) against the same code eager, fp32 on the GPU: loss, statistics, gradients."""
    from hpctoolkit.models.dflash.loss import dflash_loss
    from hpctoolkit.models.dspark.loss import dspark_loss

    g = torch.Generator().manual_seed(7)
    B, N, K, H, R, V = 2, 16, 4, 64, 8, 3000
    dev = torch.device("cuda")
    leaves = {
        "hidden": torch.randn(B, N * K, H, generator=g),
        "markov": torch.randn(B, N * K, R, generator=g),
        "W2": torch.randn(V, R, generator=g) * 0.1,
        "conf": torch.randn(B, N * K, generator=g),
    }
    W, tgt_W = torch.randn(V, H, generator=g).to(dev), torch.randn(V, H, generator=g).to(dev)
    rows = torch.randn(B, N * K, H, generator=g).to(dev)
    labels = torch.randint(0, V, (B, N * K), generator=g).to(dev)
    labels[:, ::K] = -100
    ok = torch.ones(B, N, dtype=torch.bool, device=dev)
    arms = {}
    for compiled in (False, True):
        x = {k: v.to(dev).requires_grad_() for k, v in leaves.items()}
        common = {
            "block_size": K,
            "chunk_rows": 40,
            "compile_elementwise": compiled,
            "labels_from_target": True,
        }
        if family == "dflash":
            parts = dflash_loss(x["hidden"], W, lambda r: r @ tgt_W.T, rows, labels, ok, gamma=2.0, **common)
        else:
            parts = dspark_loss(
                x["hidden"],
                x["markov"],
                W,
                x["W2"],
                x["conf"],
                lambda r: r @ tgt_W.T,
                rows,
                labels,
                ok,
                **common,
            )
        parts.numerator.backward()
        arms[compiled] = (parts.numerator.detach(), parts.stats_vector(), {k: v.grad for k, v in x.items()})
    (le, se, ge), (lc, sc, gc) = arms[False], arms[True]
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sc, se, rtol=1e-5, atol=1e-5)
    for name, ref in ge.items():
        if ref is not None:
            torch.testing.assert_close(gc[name], ref, rtol=1e-4, atol=1e-5, msg=name)
