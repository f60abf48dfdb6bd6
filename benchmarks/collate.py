"""The trainer's collate: padded on the host against packed (padded on the device), side by side.

    .venv/bin/python benchmarks/collate.py                   # the host's work a batch, CPU
    python benchmarks/collate.py --device cuda               # + the move to the GPU (`DeviceFeeder`)

Batches of 16 samples shaped like the GPU default's (SmolLM2-135M-Instruct: three aux layers of
576 and the last hidden state, bf16), with token counts drawn as the ladder's first rung had them
(exponential, mean 276, cut at 1280; that rung averaged 276 tokens a sample). Arms:

- `padded` (`collate(pack=False)`): the host zero-fills `[B, S, n_aux*H]` and `[B, S, H]` and
  copies each sample into it position-major: what the trainer did up to 2026-12-08;
- `packed` (`collate(pack=True)`): the host copies each sample's real rows once, as captured; the
  device pads them (`Batch.to`).

Per arm: the host thread's CPU milliseconds a batch (`time.thread_time`, one intra-op thread, so
a busy machine does not bend it), and with `--device cuda` the wall milliseconds of collate plus
`DeviceFeeder.put` plus a synchronize. Medians of `--reps` passes; the ratio is padded / packed.

Measured on this project's 2-core CPU machine (Intel Xeon with AMX, 24 GiB; 2026-12-08, both cores
shared with a test run):

    .venv/bin/python benchmarks/collate.py          (twice)
      host CPU a batch: padded 35.5 ms, packed 7.3 ms: x4.9 less
      host CPU a batch: padded 35.0 ms, packed 7.8 ms: x4.5 less
    (main's collate before the change, same batches: 33.9 and 40.4 ms)

On the H100 rung of 2026-12-08 the padded collate was 65 % of the trainer's main thread, at
155-185 samples/s in the spool's replay with the GPU 3-6 % busy (py-spy; `docs/what-ran-where.md`).
Not yet run on a GPU: `--device cuda` is for the next lease.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from types import SimpleNamespace

import torch

from hpctoolkit.train.batch import collate
from hpctoolkit.train.step import DeviceFeeder


def _samples(n: int, seed: int) -> list[SimpleNamespace]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        t = min(1280, max(16, int(rng.expovariate(1 / 276))))
        out.append(
            SimpleNamespace(
                key=f"s{i}",
                input_ids=torch.randint(0, 49152, (t,), generator=g),
                aux_hidden_states=torch.randn(3, t, 576, generator=g).to(torch.bfloat16),
                last_hidden_states=torch.randn(t, 576, generator=g).to(torch.bfloat16),
                loss_mask=torch.ones(t, dtype=torch.long),
                manifest=None,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--batches", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    samples = _samples(16 * args.batches, seed=0)
    batches = [samples[i : i + 16] for i in range(0, len(samples), 16)]
    feeder = DeviceFeeder(torch.device("cuda"), torch.bfloat16) if cuda else None
    cpu: dict[str, list[float]] = {"padded": [], "packed": []}
    wall: dict[str, list[float]] = {"padded": [], "packed": []}
    for _ in range(args.reps):
        for arm in ("padded", "packed"):  # interleaved, so drift hits both
            c0, w0 = time.thread_time(), time.perf_counter()
            for b in batches:
                batch = collate(
                    b, max_seq_len=1280, min_loss_tokens=14, pin_memory=cuda, pack=arm == "packed"
                )
                if feeder is not None:
                    feeder.put(batch)
            if cuda:
                torch.cuda.synchronize()
            cpu[arm].append((time.thread_time() - c0) / len(batches) * 1e3)
            wall[arm].append((time.perf_counter() - w0) / len(batches) * 1e3)
    med = {arm: statistics.median(v) for arm, v in cpu.items()}
    print(
        f"host CPU a batch: padded {med['padded']:.1f} ms, packed {med['packed']:.1f} ms: "
        f"x{med['padded'] / med['packed']:.1f} less"
    )
    if cuda:
        mw = {arm: statistics.median(v) for arm, v in wall.items()}
        print(
            f"collate + put + sync a batch: padded {mw['padded']:.1f} ms, packed {mw['packed']:.1f} ms: "
            f"x{mw['padded'] / mw['packed']:.2f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
