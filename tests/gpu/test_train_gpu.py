"""GPU checks of the trainer's own step (skipped without CUDA; run on the H200 machine).

    python -m pytest tests/gpu/test_train_gpu.py -q
    python -m pytest tests/gpu/test_train_gpu.py -q -s -k "stress or pooled"   # issue 42, item 2

The production path: `build_trainer`, `shard_trainer` (one rank: `LocalMixedPrecision`, compiled
decoder layers, FlexAttention), the fused DSpark loss, on the tiny K3 MLA draft.
"""

import dataclasses
import functools
import inspect
import json
import logging
import math
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hpctoolkit.models.registry import load_draft_config
from hpctoolkit.train.batch import collate
from hpctoolkit.train.build import build_trainer
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.fsdp import build_mesh, init_distributed, shard_trainer
from hpctoolkit.train.step import forward_backward
from hpctoolkit.train.synthetic import SyntheticSamples
from hpctoolkit.train.target_head import TargetHead

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
    runs, dynamo = {}, {}
    for name, overlapped in (("drained", False), ("again", False), ("overlapped", True)):
        with _DynamoWatch() as dyn:
            runs[name] = _run_steps(ctx, cfg, batches, overlapped=overlapped)
        dynamo[name] = dyn.summary()
    drained, again, overlapped = runs["drained"], runs["again"], runs["overlapped"]
    noise = _max_diff(drained, again)
    gap, where = _where_apart(drained, overlapped)
    print(f"drained vs drained {noise:.3e}, drained vs overlapped {gap:.3e}; dynamo {json.dumps(dynamo)}")
    # Past its recompile limit dynamo runs the layers eager: an arm that crossed it differs for
    # that reason alone (one candidate for the failures of 2026-12-06: process history, no race).
    limit_hits = {name: d["limit_hits"] for name, d in dynamo.items() if d["limit_hits"]}
    assert not limit_hits, f"torch._dynamo hit its recompile limit: {limit_hits}"
    # Two drained runs are bit for bit equal in some calls and 1e-8..1e-6 apart in others (the
    # atomics), so an overlapped run that picked up that noise when the drained pair did not is
    # allowed 1e-5; wrong data moves the statistics by whole units.
    bound = max(2 * noise, 1e-5)
    # Where (a flaky failure in the tier of 2026-12-06, after the vLLM engine tests, passed alone,
    # in a smaller module run and beside a loaded GPU): which step and statistic, or parameter.
    recompiles = {name: d["recompiles"] for name, d in dynamo.items()}
    assert gap <= bound, (
        f"overlapped steps differ by {gap:.3e} ({where}); two drained runs by {noise:.3e}; "
        f"recompiles per run {recompiles}"
    )


# ---- The overlapped steps under stress (issue 42, item 2) --------------------------------------
#
# The test above failed twice on CUDA (0.60 and 1.87 apart) and passed 14 other times. Repeating it
# settles nothing: the windows a race needs are left to chance. The stress version below opens
# them on purpose and shows, with positive controls, that it would catch each race it is there for.

# `HPCTOOLKIT_STRESS_DROP=wait_stream|record_stream`: the stress test runs a copy of
# `DeviceFeeder.put` without that call (what the control tests below set in a child process).
STRESS_DROP = os.environ.get("HPCTOOLKIT_STRESS_DROP", "")
# The line of `DeviceFeeder.put` each control removes.
FEEDER_SYNC_LINES = {
    "wait_stream": "compute.wait_stream(self.stream)",
    "record_stream": "t.record_stream(compute)",
}
# The compute stream's spin before each step reads its batch, at least this long (and at least
# twice a drained step); the copy stream's spin before each copy is three times spin plus step.
STRESS_SPIN_MS = float(os.environ.get("HPCTOOLKIT_STRESS_SPIN_MS", "25"))
# Blocks the probe allocates per freed tensor of a moved batch, to drain every free block of that
# size from the copy stream's pool (earlier probes' blocks too) so a freed one cannot hide.
PROBES_PER_TENSOR = 4
REPORT_TAG = "STRESS-REPORT "
ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def _cycles_per_ms() -> float:
    """`torch.cuda._sleep` cycles per millisecond on this GPU (about 2e6 on an H200)."""
    cycles = 50_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / start.elapsed_time(end)


class _DynamoWatch:
    """torch._dynamo's counters over a block (their increments), the recompiles it recorded
    (`guard_failures`) and any recompile-limit warning logged meanwhile. Past its recompile limit
    dynamo runs a frame eager from then on: numbers a few bf16 roundings off the compiled ones, so
    a run that crossed it cannot be compared with one that did not."""

    LIMIT = re.compile(r"hit config\.\w*(recompile|cache_size)_limit")

    def __enter__(self) -> "_DynamoWatch":
        from torch._dynamo import utils

        self._counts = self._counters()
        self._failures = {code: len(r) for code, r in utils.guard_failures.items()}
        self.records: list[str] = []
        records = self.records

        class Collect(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                records.append(record.getMessage())

        self._handler = Collect(logging.WARNING)
        self._logger = logging.getLogger("torch._dynamo")  # torch stops propagation here
        self._logger.addHandler(self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        from torch._dynamo import utils

        self._logger.removeHandler(self._handler)
        after = self._counters()
        self.counts = {k: n - self._counts.get(k, 0) for k, n in after.items() if n != self._counts.get(k, 0)}
        new = [
            reason
            for code, reasons in utils.guard_failures.items()
            for reason in reasons[self._failures.get(code, 0) :]
        ]
        self.recompiles, self.reasons = len(new), [r[:300] for r in new[-3:]]
        self.limit_hits = [r.splitlines()[0] for r in self.records if self.LIMIT.search(r)]
        self.limit_hits += [k for k in self.counts if "recompile limit" in k.lower()]

    @staticmethod
    def _counters() -> dict[str, int]:
        from torch._dynamo.utils import counters

        out: dict[str, int] = {}
        for cat, c in counters.items():
            for key, n in c.items():  # a graph break's key is its whole explanation: its first line
                name = f"{cat}/{str(key).splitlines()[0][:160]}"
                out[name] = out.get(name, 0) + int(n)
        return out

    def summary(self) -> dict:
        return {
            "recompiles": self.recompiles,
            "recompile_reasons": self.reasons,
            "limit_hits": self.limit_hits,
            "counters": self.counts,
        }


def _put_without(call: str):
    """`DeviceFeeder.put` as shipped, with the one line that makes `call` replaced by `pass`: a
    positive control built from the current source, so it never drifts from what it controls."""
    from hpctoolkit.train import step as step_module

    line = FEEDER_SYNC_LINES[call]
    src = textwrap.dedent(inspect.getsource(step_module.DeviceFeeder.put)).splitlines()
    hits = [i for i, text in enumerate(src) if text.split("#")[0].strip() == line]
    assert len(hits) == 1, f"DeviceFeeder.put no longer has exactly one line `{line}`: update the control"
    indent = src[hits[0]][: len(src[hits[0]]) - len(src[hits[0]].lstrip())]
    src[hits[0]] = f"{indent}pass  # `{line}` removed: a positive control"
    namespace = dict(vars(step_module))
    exec(compile("\n".join(src), f"<DeviceFeeder.put without {call}>", "exec"), namespace)
    return namespace["put"]


def _moved_tensors(batch) -> list[torch.Tensor]:
    """The tensors `DeviceFeeder.put` allocates on its copy stream (the ones it marks in use)."""
    out = [batch.input_ids_BS, batch.context_BSC, batch.last_BSH, batch.valid_BS, batch.lengths_B]
    return out + [batch.weight_B] + ([batch.supervised] if batch.supervised is not None else [])


def _poison_(t: torch.Tensor) -> None:
    """NaN where a NaN can go; zeros (token 0, not a token past the vocabulary: no device assert)
    in integer and boolean tensors."""
    t.fill_(float("nan") if t.dtype.is_floating_point else 0)


def _reuse_freed_blocks(
    stream: torch.cuda.Stream, freed: list[tuple[int, torch.Size, torch.dtype]], device: torch.device
) -> int:
    """Force the caching allocator to hand out again, on the copy stream, every block of the sizes
    a moved batch just freed, and poison them there. A block the allocator gives back while a
    queued step still reads it (a tensor not marked in use on that step's stream: `record_stream`)
    is overwritten before the step reads it. Returns how many of the freed blocks came back."""
    ptrs = {ptr for ptr, _, _ in freed}
    with torch.cuda.stream(stream):
        probes = [
            torch.empty(shape, dtype=dtype, device=device)
            for _, shape, dtype in freed
            for _ in range(PROBES_PER_TENSOR)
        ]
        for t in probes:
            _poison_(t)
    return len(ptrs & {t.data_ptr() for t in probes})


def _full_stats(res) -> torch.Tensor:
    """Every number of a step: `StepResult.stats`, then the token counts and the gradient norm."""
    tail = torch.tensor([res.supervised_tokens, res.tokens, res.grad_norm], dtype=torch.float64)
    return torch.cat([res.stats.to(torch.float64), tail])


def _stat_names(n: int, extras: tuple[str, ...]) -> list[str]:
    """Names of `_full_stats`' entries (`LossParts.stats_vector`'s order); `entry i` if it changed."""
    p, rest = divmod(n - 6 - len(extras), 5)
    if rest or p < 0:
        return [f"entry {i}" for i in range(n)]
    names = ["denominator", "numerator"]
    for part in ("pos_loss_sum", "pos_weight", "pos_correct", "pos_count", "reach"):
        names += [f"{part}[{k}]" for k in range(p)]
    return [*names, "chains", *extras, "supervised_tokens", "tokens", "grad_norm"]


@dataclasses.dataclass
class _Arm:
    stats: torch.Tensor  # [steps, entries] fp64, `_full_stats` of each step
    params: dict[str, torch.Tensor]
    names: list[str]
    # Median span on the device of a drained step's launch (after the first, which compiles); an
    # upper bound of the step's own time where the host is slower to queue it than the device to run it.
    step_ms: float = 0.0
    reused_blocks: int = 0  # freed moved-batch blocks the allocator handed out again at once
    dynamo: dict = dataclasses.field(default_factory=dict)


def _pairs_batch(src, pair, pin: bool):
    return collate([src.sample(i) for i in pair], max_seq_len=512, min_loss_tokens=14, pin_memory=pin)


def _drained_arm(ctx, cfg, src, pairs) -> _Arm:
    """Each step queued and drained before the next, its batch moved by a plain copy."""
    from hpctoolkit.train.step import launch

    trainer, opt, sched = _trainer(ctx, cfg)
    stats, spans, extras = [], [], ()
    for step, pair in enumerate(pairs):
        batch = _pairs_batch(src, pair, pin=False).to(ctx.device, torch.bfloat16)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launched = launch(trainer, opt, sched, batch, step, ctx, cfg.grad_clip)
        end.record()
        stats.append(_full_stats(launched.result()))
        torch.cuda.synchronize()
        extras = launched.extras
        if step:  # the first one compiles
            spans.append(start.elapsed_time(end))
    st = torch.stack(stats)
    params = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    return _Arm(st, params, _stat_names(st.shape[1], extras), step_ms=sorted(spans)[len(spans) // 2])


def _stressed_arm(ctx, cfg, src, pairs, compute_cycles: int, copy_cycles: int) -> _Arm:
    """The loop's order (`one_ahead`, `DeviceFeeder`) with every window a race needs held open:

    - each batch is collated into fresh page-locked buffers, and poisoned (NaN) as soon as its
      step's statistics are read, the earliest the loop could hand those buffers on;
    - the copy stream spins before each copy, longer than a step and the compute spin together:
      a step that does not wait for its copy reads its batch before the copy has written it;
    - the compute stream spins after the wait for the copy, before the step reads its batch;
      meanwhile the blocks the moved batch freed are taken again on the copy stream and poisoned
      (`_reuse_freed_blocks`): a batch not marked in use on the compute stream is overwritten
      before its step reads it.
    """
    from hpctoolkit.train.step import DeviceFeeder, launch, one_ahead

    trainer, opt, sched = _trainer(ctx, cfg)
    feeder = DeviceFeeder(ctx.device, torch.bfloat16)
    held, reused, extras = {}, [0], [()]

    def launches():
        for step, pair in enumerate(pairs):
            host = _pairs_batch(src, pair, pin=True)
            with torch.cuda.stream(feeder.stream):
                torch.cuda._sleep(copy_cycles)
            moved = feeder.put(host)
            freed = [(t.data_ptr(), t.shape, t.dtype) for t in _moved_tensors(moved)]
            torch.cuda._sleep(compute_cycles)
            launched = launch(trainer, opt, sched, moved, step, ctx, cfg.grad_clip)
            del moved  # the loop keeps no reference either: its blocks go back to the allocator
            reused[0] += _reuse_freed_blocks(feeder.stream, freed, ctx.device)
            held[step] = host
            extras[0] = launched.extras
            yield launched

    stats = []
    for step, launched in enumerate(one_ahead(launches())):
        stats.append(_full_stats(launched.result()))
        # The step waited for its copy: the host may write these buffers from here on.
        for t in _moved_tensors(held.pop(step)):
            _poison_(t)
    torch.cuda.synchronize()
    st = torch.stack(stats)
    params = {n: p.detach().clone() for n, p in trainer.named_parameters()}
    return _Arm(st, params, _stat_names(st.shape[1], extras[0]), reused_blocks=reused[0])


def _apart(ref: _Arm, got: _Arm, bound: float) -> tuple[float, str]:
    """The largest difference between two arms and a line that names it: the statistic and step of
    the largest, the first step whose statistics differ beyond `bound` (and in which), the
    parameter furthest apart. NaN against a number counts as infinitely far."""

    def dist(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = a.double(), b.double()
        same = (a == b) | (a.isnan() & b.isnan())
        return torch.where(same, 0.0, (a - b).abs().nan_to_num(nan=math.inf))

    d = dist(ref.stats, got.stats)
    step, entry = divmod(int(d.argmax()), d.shape[1])
    stat_gap = float(d[step, entry])
    params = {n: float(dist(p, got.params[n]).max()) for n, p in ref.params.items()}
    worst = max(params, key=lambda n: params[n])
    name = ref.names[entry] if entry < len(ref.names) else f"entry {entry}"
    parts = [
        f"largest in statistic {name} at step {step}: {float(ref.stats[step, entry])!r} against "
        f"{float(got.stats[step, entry])!r} ({stat_gap:.3e} apart, "
        f"{stat_gap / max(abs(float(ref.stats[step, entry])), 1e-30):.2e} relative)"
    ]
    differing = (d > bound).any(dim=1).nonzero().flatten().tolist()
    if differing:
        which = [ref.names[i] for i in (d[differing[0]] > bound).nonzero().flatten().tolist()]
        more = f" and {len(which) - 6} more" if len(which) > 6 else ""
        parts.append(f"first step apart: {differing[0]} of {d.shape[0]}, in {', '.join(which[:6])}{more}")
    else:
        parts.append(f"no step's statistics more than {bound:.1e} apart")
    parts.append(f"parameters furthest apart: {worst}, {params[worst]:.3e}")
    return max(stat_gap, params[worst]), "; ".join(parts)


def test_overlapped_steps_under_stress(ctx, monkeypatch):
    """`test_overlapped_steps_train_as_drained_ones` with the windows a race needs held open on
    purpose (`_stressed_arm`: spins on the compute and the copy stream, fresh page-locked batches
    poisoned right after use, the allocator forced to hand freed device blocks out again), over 8
    distinct batches: the same statistics (loss parts, token counts, gradient norm) and weights as
    the steps drained one at a time, within twice what two drained runs differ by (or 1e-5).
    Each arm's torch._dynamo counters are recorded; a recompile-limit warning in any arm fails the
    test (an arm that fell back to eager differs for that reason alone). One `STRESS-REPORT` line
    of JSON says what differed, if anything.

    With `HPCTOOLKIT_STRESS_DROP` set (the controls below, in a child process) `DeviceFeeder.put`
    lacks that call, and the test asserts the opposite: the stressed steps must differ."""
    from hpctoolkit.train.step import DeviceFeeder

    if STRESS_DROP:
        monkeypatch.setattr(DeviceFeeder, "put", _put_without(STRESS_DROP))
    cfg = TrainingConfig(
        num_anchors=24, device="cuda", mixed_precision="bf16", max_seq_len=512, steps=8, warmup_steps=1
    )
    src = SyntheticSamples(
        num_samples=16, vocab_size=512, hidden_size=128, num_aux=3, lengths=[512, 400, 300], seed=5
    )
    pairs = [(2 * i, 2 * i + 1) for i in range(8)]
    arms: dict[str, _Arm] = {}
    for name in ("drained", "again"):
        with _DynamoWatch() as dyn:
            arms[name] = _drained_arm(ctx, cfg, src, pairs)
        arms[name].dynamo = dyn.summary()
    # The copy spin outlasts the compute spin and a step with room to spare (3x), so that without
    # the wait a step reads its batch before the copy: the compute stream runs ahead of the copies.
    # Capped: under the sanitizer (eager, every kernel checked on the host) a step takes seconds,
    # and its verdict rests on the streams' events, not on timing.
    step_ms = min(arms["drained"].step_ms, 1000.0)
    compute_ms = max(STRESS_SPIN_MS, 2 * step_ms)
    copy_ms = 3 * (compute_ms + step_ms)
    with _DynamoWatch() as dyn:
        cycles = _cycles_per_ms()
        arms["stressed"] = _stressed_arm(
            ctx, cfg, src, pairs, int(compute_ms * cycles), int(copy_ms * cycles)
        )
    arms["stressed"].dynamo = dyn.summary()
    noise, _ = _apart(arms["drained"], arms["again"], math.inf)
    bound = max(2 * noise, 1e-5)
    gap, where = _apart(arms["drained"], arms["stressed"], bound)
    limit_hits = {name: arm.dynamo["limit_hits"] for name, arm in arms.items() if arm.dynamo["limit_hits"]}
    report = {
        "drop": STRESS_DROP or None,
        "differs": gap > bound,
        "gap": gap,
        "bound": bound,
        "drained_noise": noise,
        "where": where,
        "step_ms": arms["drained"].step_ms,
        "compute_spin_ms": compute_ms,
        "copy_spin_ms": copy_ms,
        "freed_blocks_handed_out_again": arms["stressed"].reused_blocks,
        "limit_hits": limit_hits,
        "dynamo": {name: arm.dynamo for name, arm in arms.items()},
        "sanitizer": "TORCH_CUDA_SANITIZER" in os.environ,
    }
    print(REPORT_TAG + json.dumps(report), flush=True)
    dynamo = {name: (arm.dynamo["recompiles"], arm.dynamo["counters"]) for name, arm in arms.items()}
    assert not limit_hits, (
        f"torch._dynamo hit its recompile limit: {limit_hits}; recompiles, counters {dynamo}"
    )
    if STRESS_DROP:
        assert gap > bound, (
            f"DeviceFeeder.put without `{FEEDER_SYNC_LINES[STRESS_DROP]}` trained as the drained steps "
            f"({gap:.3e} apart, bound {bound:.3e}; {where}; {arms['stressed'].reused_blocks} freed blocks "
            "handed out again): the stress does not open the window this control needs"
        )
    else:
        assert gap <= bound, (
            f"stressed overlapped steps differ by {gap:.3e} (bound {bound:.3e}, two drained runs "
            f"{noise:.3e}): {where}; recompiles, dynamo counters per arm {dynamo}"
        )


def _child_run(tmp_path: Path, env: dict[str, str | None], timeout_s: int = 540):
    """`test_overlapped_steps_under_stress` in a fresh process with `env` changed (None: unset):
    (return code, its output, its STRESS-REPORT or None). A child of its own, because a control
    may leave the CUDA context unusable (a kernel that read garbage token ids asserts) and
    because TORCH_CUDA_SANITIZER is read when torch is imported."""
    child_env = dict(os.environ)
    for key, value in env.items():
        if value is None:
            child_env.pop(key, None)
        else:
            child_env[key] = value
    cmd = [
        sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", "-o", "addopts=",
        "-q", "-s", "-ra", "--basetemp", str(tmp_path / "child"),
        "tests/gpu/test_train_gpu.py::test_overlapped_steps_under_stress",
    ]  # fmt: skip
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        pytest.fail(f"the child ran past {timeout_s} s; its output ends:\n{out[-4000:]}")
    out = done.stdout + done.stderr
    reports = [
        json.loads(line[len(REPORT_TAG) :]) for line in out.splitlines() if line.startswith(REPORT_TAG)
    ]
    return done.returncode, out, (reports[-1] if reports else None)


DEVICE_FAULT = re.compile(r"CUDA error|device-side assert|illegal memory access|AcceleratorError")


@pytest.mark.parametrize("drop", sorted(FEEDER_SYNC_LINES))
def test_the_stress_catches_a_feeder_without(drop, tmp_path):
    """Positive controls: the stress test, run with `DeviceFeeder.put` missing its
    `compute.wait_stream(copy)` (a step may read its batch before the copy has written it) or
    its `record_stream(compute)` calls (the allocator may hand a step's batch to the next copy
    before the step has read it), must see the difference, each in a child process. A control
    that instead breaks the device (a kernel that read garbage asserts) caught it too."""
    rc, out, report = _child_run(tmp_path, {"HPCTOOLKIT_STRESS_DROP": drop, "TORCH_CUDA_SANITIZER": None})
    print(f"control without {drop}: rc {rc}, report {json.dumps(report)}")
    if report is None:
        assert DEVICE_FAULT.search(out), (
            f"the control without {drop} neither reported nor faulted:\n{out[-6000:]}"
        )
        return
    assert not report["limit_hits"], f"the control's arms crossed the recompile limit: {report['limit_hits']}"
    assert report["differs"], (
        f"without {drop} the stressed steps trained as the drained ones: the stress cannot catch that "
        f"race ({report['where']}; {report['freed_blocks_handed_out_again']} freed blocks handed out again)"
    )
    # Its return code is not checked: a kernel that read garbage may still fault after the report.


@pytest.mark.parametrize("drop", ["", "wait_stream"], ids=["as_shipped", "without_wait_stream"])
def test_the_stressed_steps_under_the_cuda_sanitizer(drop, tmp_path):
    """The stress test in a child under `TORCH_CUDA_SANITIZER=1` (torch's CSAN, which checks every
    ATen kernel's reads and writes against the streams' events): the feeder as shipped must run
    clean, and the control without `wait_stream` must be reported as a data race, which shows the
    sanitizer sees the feeder's streams at all. While its dispatch mode is on, dynamo skips every
    frame, so the child's trainer runs eager. CSAN forgets a block's accesses when the block is
    freed, so it cannot see a missing `record_stream`: `_reuse_freed_blocks` is that check."""
    env = {"TORCH_CUDA_SANITIZER": "1", "HPCTOOLKIT_STRESS_DROP": drop or None}
    rc, out, report = _child_run(tmp_path, env)
    races = out.count("CSAN detected a possible data race")
    print(
        f"under the sanitizer, drop {drop or 'nothing'}: rc {rc}, {races} race(s), report {json.dumps(report)}"
    )
    if drop:
        assert races > 0, f"CSAN saw no race without {drop}:\n{out[-6000:]}"
    else:
        assert races == 0 and rc == 0, (
            f"the feeder as shipped under CSAN (rc {rc}, {races} races):\n{out[-8000:]}"
        )


@pytest.mark.parametrize("hardened", [True, False], ids=["as_shipped", "without_the_event"])
def test_a_pooled_buffer_goes_out_again_only_after_its_copy_has_read_it(hardened, monkeypatch):
    """`Sample.copy_to` from a page-locked pooled buffer, queued behind a 200 ms spin on a side
    stream; the sample is released and the same buffer taken again at once, then poisoned (NaN).
    As shipped, `BufferPool.take` waits for the copy's event: the GPU copy holds the sample's
    values and the take lasted most of the spin. Control: with the event never recorded (the pool
    before issue 42), the buffer goes out mid-spin and the copy reads the poison."""
    from hpctoolkit.capture import build_manifest
    from hpctoolkit.data.sample import BufferPool, Sample

    if not hardened:
        monkeypatch.setattr(Sample, "in_use_until", lambda self, event: None)
    m = build_manifest("pooled", [1, 3, 4], 2048, 1024, 4, 1, "bfloat16", extra={})
    pool = BufferPool(1, pin=True)
    a = Sample.empty_for(m, pool)
    a.input_ids.copy_(torch.arange(2048))
    a.aux_hidden_states.fill_(1.5)
    a.last_hidden_states.fill_(-2.5)
    side, spin_ms = torch.cuda.Stream(), 200.0
    with torch.cuda.stream(side):
        torch.cuda._sleep(int(spin_ms * _cycles_per_ms()))
        on_gpu = a.copy_to(torch.device("cuda"))
    ptr = a.input_ids.data_ptr()
    a.release()
    t0 = time.monotonic()
    b = Sample.empty_for(m, pool)
    took_ms = (time.monotonic() - t0) * 1e3
    assert b.input_ids.data_ptr() == ptr, "the pool did not hand the same buffer out again"
    b.input_ids.fill_(0)
    b.aux_hidden_states.fill_(float("nan"))
    b.last_hidden_states.fill_(float("nan"))
    side.synchronize()
    wrong = int((on_gpu.aux_hidden_states != 1.5).sum() + (on_gpu.last_hidden_states != -2.5).sum())
    wrong += int((on_gpu.input_ids.cpu() != torch.arange(2048)).sum())
    print(f"take lasted {took_ms:.1f} ms of a {spin_ms:.0f} ms spin; {wrong} wrong values on the GPU")
    if hardened:
        assert wrong == 0, f"the copy read the next sample's bytes: {wrong} wrong values"
        assert took_ms > 0.5 * spin_ms, f"take returned after {took_ms:.1f} ms, before the copy could run"
    else:
        assert wrong > 0, "without the event the copy still read the right bytes: the spin opens no window"


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_batch_packed_on_the_host_is_padded_on_the_device_bitwise(dtype):
    """`collate(pin_memory=True)` packs the real rows into page-locked memory; the feeder moves
    them on its side stream and pads them there. The same tensors as padding on the host, bit for
    bit, with a step queued on the compute stream before and after (`DeviceFeeder`)."""
    from types import SimpleNamespace

    from hpctoolkit.train.step import DeviceFeeder

    g = torch.Generator().manual_seed(3)

    def sample(i, n):
        return SimpleNamespace(
            key=f"s{i}",
            input_ids=torch.randint(0, 50, (n,), generator=g),
            aux_hidden_states=torch.randn(3, n, 576, generator=g).to(torch.bfloat16),
            last_hidden_states=torch.randn(n, 576, generator=g).to(torch.bfloat16),
            loss_mask=torch.ones(n, dtype=torch.long),
            manifest=None,
        )

    feeder = DeviceFeeder(torch.device("cuda"), dtype)
    busy = torch.randn(4096, 4096, device="cuda")
    for lengths in ([1280, 17, 300, 5], [1], [640] * 16, [2000, 3]):
        samples = [sample(i, n) for i, n in enumerate(lengths)]
        kw = {"max_seq_len": 1280, "min_loss_tokens": 2, "pin_memory": True, "step": 80}
        host = collate(samples, pack=False, **kw)
        packed = collate(samples, **kw)
        assert packed.packed is not None and packed.packed.aux_LTH.is_pinned()
        busy @ busy  # the compute stream has work queued when the side stream copies
        a, b = feeder.put(host), feeder.put(packed)
        c = (busy @ busy).sum()  # and after
        torch.cuda.synchronize()
        assert torch.isfinite(c)
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if isinstance(x, torch.Tensor):
                assert x.is_cuda and y.is_cuda and x.dtype == y.dtype, f.name
                assert torch.equal(x, y), f.name
