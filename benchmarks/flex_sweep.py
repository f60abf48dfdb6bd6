# ruff: noqa: N806  -- shape names, per STYLE.md
"""Sweep FlexAttention kernel options on the K3 DSpark MLA draft's attention problem (H200).

    PYTHONPATH=. python benchmarks/flex_sweep.py [--batch 2 --seq 4096 --blocks 512]

One attention call of the K3 draft at its training shape: 64 heads, qk dim 192 (128 nope + 64
rope), v dim 128, queries = blocks x 7 draft slots, keys = context + draft, the production block
mask (`make_block_layout`). For each kernel-options set it times forward and forward+backward
(CUDA events, median of `--reps`) and prints one JSON line; the default options come first.
`--autotune` instead lets inductor's max-autotune pick (it searches only BLOCK_N <= 64 on CUDA).

Measured 2026-11-30 on one H200 (torch 2.11, triton 3.6), defaults (27 % mask density, 0.60
TFLOP forward per call), backward time = (forward+backward) - forward:

| backward (M1, N1, M2, N2, stages, warps) | backward | TFLOP/s |
|------------------------------------------|----------|---------|
| inductor default (64, 64, 64, 64, 2, 4)  | 14.7 ms  | 102     |
| max-autotune's pick (32, 64, 64, 32, 1, 4)| 14.8 ms | 101     |
| (64, 128, 128, 64, 2, 8)                 | 9.0 ms   | 166     |
| (32, 128, 128, 32, 2, 8)                 | 8.5 ms   | 176     |
| (32, 128, 128, 32, 3, 8) (chosen)        | 8.1 ms   | 185     |
| (32, 128, 128, 32, 3, 4)                 | 36.9 ms  | 41      |

Forward: default (128, 64, 3, 4) 2.8 ms; (128, 64, 2, 8) (chosen) 2.6 ms; (128, 128, 2, 8) and
(64, 128, 3, 4) exceed shared memory. Triton pads the qk dim 192 to 256, hence the small tiles.
"""

import argparse
import json
import statistics

import torch
from torch.nn.attention.flex_attention import flex_attention

from hpctoolkit.models.dflash.layout import make_block_layout, sample_anchors

# (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_stages, num_warps) for the backward kernel.
BWD = [
    None,
    (64, 64, 64, 64, 3, 4),
    (64, 64, 64, 64, 2, 8),
    (64, 64, 64, 64, 1, 8),
    (32, 64, 64, 32, 3, 4),
    (32, 64, 64, 32, 2, 4),
    (64, 128, 128, 64, 2, 8),
    (64, 128, 128, 64, 1, 8),
    (32, 128, 128, 32, 3, 4),
    (32, 128, 128, 32, 2, 8),
    (32, 128, 128, 32, 1, 8),
    (32, 128, 128, 32, 3, 8),
    (32, 128, 128, 32, 2, 4),
    (32, 64, 64, 32, 2, 8),
    (64, 128, 128, 64, 2, 4),
    (16, 128, 128, 16, 2, 8),
]
# (BLOCK_M, BLOCK_N, num_stages, num_warps) for the forward kernel.
FWD = [None, (128, 64, 2, 8), (128, 128, 1, 8), (128, 64, 1, 8), (128, 32, 2, 8), (64, 64, 2, 4)]


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tma", action="store_true", help="also try USE_TMA on each set")
    ap.add_argument("--autotune", action="store_true", help="only inductor's max-autotune choice")
    a = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    dev = torch.device("cuda")
    B, S, H, bs = a.batch, a.seq, 64, 7
    gen = torch.Generator().manual_seed(0)
    anchors, _ = sample_anchors(torch.ones(B, S), a.blocks, bs, generator=gen)
    layout = make_block_layout(anchors.to(dev), bs, S)
    mask = layout.attention_mask().block_mask()
    Q, K = layout.draft_len, S + layout.draft_len
    q = torch.randn(B, Q, H, 192, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(B, K, H, 192, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    v = torch.randn(B, K, H, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    g = torch.randn(B, H, Q, 128, device=dev, dtype=torch.bfloat16)
    pairs = float((bs * (anchors.double() + bs)).sum())
    fwd_flop = pairs * 2 * H * (192 + 128)
    print(json.dumps({"shape": [B, H, Q, K], "density": pairs / (B * Q * K), "fwd_tflop": fwd_flop / 1e12}))
    mode = "max-autotune-no-cudagraphs" if a.autotune else None
    compiled = torch.compile(flex_attention, dynamic=False, mode=mode)

    def run(opts: dict, label: str) -> None:
        try:
            f = lambda: compiled(q, k, v, block_mask=mask, scale=192**-0.5, kernel_options=opts or None)  # noqa: E731
            fwd = timed(f, a.reps)

            def fb():
                out = f()
                out.backward(g)

            both = timed(fb, a.reps)
            print(
                json.dumps(
                    {
                        "opts": label,
                        "fwd_ms": round(fwd, 2),
                        "bwd_ms": round(both - fwd, 2),
                        "fwd_tflops": round(fwd_flop / fwd / 1e9, 1),
                        "bwd_tflops": round(2.5 * fwd_flop / (both - fwd) / 1e9, 1),
                    }
                ),
                flush=True,
            )
        except Exception as exc:  # keep sweeping: one config may not fit shared memory
            print(json.dumps({"opts": label, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}), flush=True)
        q.grad = k.grad = v.grad = None

    if a.autotune:
        run({}, "max-autotune")
        return
    for fwd in FWD:
        opts = (
            {}
            if fwd is None
            else dict(
                zip(("fwd_BLOCK_M", "fwd_BLOCK_N", "fwd_num_stages", "fwd_num_warps"), fwd, strict=True)
            )
        )
        run(opts, f"fwd={fwd}")
    for bwd in BWD:
        names = (
            "bwd_BLOCK_M1",
            "bwd_BLOCK_N1",
            "bwd_BLOCK_M2",
            "bwd_BLOCK_N2",
            "bwd_num_stages",
            "bwd_num_warps",
        )
        opts = {} if bwd is None else dict(zip(names, bwd, strict=True))
        run(opts, f"bwd={bwd}")
        if a.tma:
            run({**opts, "USE_TMA": True}, f"bwd={bwd}+tma")


if __name__ == "__main__":
    main()
