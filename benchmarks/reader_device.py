"""Where a CUDA trainer's fetch time goes: `fetch_sample(device=cuda)` phase by phase.

    python benchmarks/reader_device.py [--iters 15] [--tokens 4096] [--hidden 7168] [--layers 5] [--profile]

`benchmarks/store_path.py --device cuda` found the checked fetch (wmix64 sums checked on the GPU)
12 ms slower than fetch-then-copy without sums, while the sums alone take 0.7 ms. This script
takes the store out (an in-process store of host tensors; the sample and its manifest are the
production ones) and times, side by side in each iteration and with page-locked pooled buffers
as a CUDA trainer has them:

* `copy`: the unsummed sample fetched, then `Sample.copy_to` on the current stream;
* `check`: the summed sample through `fetch_sample(device=cuda)` (the product);
* `check_current`: the same with the check's stream set to the current stream;
* `copy_side`: the unsummed sample copied on a side stream, the host waiting for that stream;
* `copy_sum`: the unsummed sample copied on the current stream, then summed there.

Each ends when its device copy is complete. Per arm it prints the median of the whole and of
each phase (host wall time: fill, host checks, the device check, the copy's own GPU time from
CUDA events around `Sample.copy_to`), and how many device segments the allocator created.
`--profile` adds torch.profiler's table for two iterations of `copy` and `check`.

Measured 2026-12-06 on one H100 80GB HBM3 (`benchmarks/gpu_node.sh start install reader`, that is
`$HPC/venv/bin/python benchmarks/reader_device.py --iters 15 --profile`), 280 MiB:

    copy             12.63 ms  1.000x   fill 4.85, copy on GPU 7.40 ms
    check            13.18 ms  1.040x   fill 5.06, device check 7.93 (copy on GPU 7.61 ms)
    check_current    13.36 ms  1.045x   the check on the current stream: no better
    copy_side        12.93 ms  1.016x
    copy_sum         13.01 ms  1.018x
    no new device segments in any arm after the first iteration

So the check costs about 0.5 ms over the copy the trainer makes anyway, and its own stream costs
nothing measurable. The 12 ms in `store_path.py` were that benchmark's: its reader freed another
arm's 280 MiB buffer inside the checked arm's timing (fixed there the same day).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.store_path import PHASES, time_fetch_steps, timed_step  # the same step timers
from hpctoolkit.capture.manifest import UNSUMMED_SCHEMA_VERSION, Manifest, build_manifest
from hpctoolkit.data.sample import BufferPool, Sample
from hpctoolkit.integrity import devsum
from hpctoolkit.store import fragments
from hpctoolkit.store.api import MissingKeysError


class HeldStore:
    """Objects kept as host tensors; `get_into` is one `copy_` per object."""

    def __init__(self) -> None:
        self.objects: dict[str, torch.Tensor] = {}

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        for key, t in items:
            self.objects[key] = t.detach().to("cpu").contiguous().view(-1).view(torch.uint8).clone()

    def get_into(self, keys: Sequence[str], dests: Sequence[torch.Tensor]) -> None:
        missing = [k for k in keys if k not in self.objects]
        if missing:
            raise MissingKeysError(missing)
        for key, dst in zip(keys, dests, strict=True):
            dst.view(-1).view(torch.uint8).copy_(self.objects[key])

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.objects for k in keys]

    def remove(self, keys: Sequence[str]) -> None:
        pass

    def close(self) -> None:
        pass


COPY_EVENTS: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []


def _instrument() -> None:
    time_fetch_steps()
    devsum.digests8 = timed_step("digests8", devsum.digests8)
    copy_to = Sample.copy_to

    def timed_copy(self: Sample, device: torch.device) -> Sample:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        out = copy_to(self, device)
        PHASES["copy_to (host)"] = PHASES.get("copy_to (host)", 0.0) + time.perf_counter() - t0
        end.record()
        COPY_EVENTS.append((start, end))
        return out

    Sample.copy_to = timed_copy  # type: ignore[method-assign]


@contextlib.contextmanager
def _check_stream_is_current(dev: torch.device) -> Iterator[None]:
    fragments._copy_stream(dev)  # this thread's table of copy streams exists
    streams = fragments._copy_streams.by_device
    saved = dict(streams)
    streams[dev] = torch.cuda.current_stream(dev)
    try:
        yield
    finally:
        streams.clear()
        streams.update(saved)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--profile", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("reader_device.py: needs a CUDA device")
    dev = torch.device("cuda", torch.cuda.current_device())
    ids = [*(2 + 12 * i for i in range(args.layers - 1)), 61]
    summed = build_manifest(
        "s", ids, args.tokens, args.hidden, 61, 2, "bfloat16", sums_algorithm=devsum.ALGORITHM
    )
    plain = dataclasses.replace(
        build_manifest("p", ids, args.tokens, args.hidden, 61, 2, "bfloat16"),
        sums=(),
        schema_version=UNSUMMED_SCHEMA_VERSION,
    )
    store = HeldStore()
    g = torch.Generator().manual_seed(0)
    layers = {f.layer_id: torch.randn(f.shape, generator=g).to(torch.bfloat16) for f in summed.fragments}
    tokens = torch.randint(0, 150000, (args.tokens,), generator=g)
    for m in (summed, plain):
        for stage in range(m.pp_size):
            own = {k: v for k, v in layers.items() if m.fragments[m.layer_ids.index(k)].stage == stage}
            sums = (
                dict(zip(own, devsum.digests8([v.to(dev) for v in own.values()]), strict=True))
                if m.sums
                else None
            )
            fragments.publish_stage(store, m, stage, own, tokens if stage == 0 else None, sums)
    _instrument()
    pools = {name: BufferPool(1, pin=True) for name in ARMS}
    side = torch.cuda.Stream(dev)
    kept: dict[str, Sample] = {}

    def run(name: str) -> tuple[float, dict[str, float], float, int]:
        PHASES.clear()
        COPY_EVENTS.clear()
        kept.pop(name, None)  # the arm's previous sample is freed before its next, as a trainer's step does
        segs = torch.cuda.memory_stats(dev).get("segment.all.allocated", 0)
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        s = ARMS[name](summed, plain, store, pools[name], dev, side)
        torch.cuda.synchronize(dev)
        t = time.perf_counter() - t0
        copy_ms = sum(a.elapsed_time(b) for a, b in COPY_EVENTS)
        kept[name] = s
        s.release()
        return t, dict(PHASES), copy_ms, torch.cuda.memory_stats(dev).get("segment.all.allocated", 0) - segs

    res: dict[str, list[tuple[float, dict[str, float], float, int]]] = defaultdict(list)
    names = list(ARMS)
    for i in range(args.iters + 1):
        for k in range(len(names)):
            name = names[(i + k) % len(names)]
            out = run(name)
            if i:
                res[name].append(out)
    base = [r[0] for r in res["copy"]]
    print(
        f"sample {summed.nbytes / 2**20:.1f} MiB ({args.tokens} tokens x {args.hidden} x {args.layers} layers bf16), "
        f"in-process store, pinned pooled buffers, medians of {args.iters}; {torch.cuda.get_device_name(dev)}"
    )
    for name in names:
        rows = res[name]
        whole = statistics.median(r[0] for r in rows) * 1e3
        ratio = statistics.median(r[0] / b for r, b in zip(rows, base, strict=True))
        phases = sorted({k for r in rows for k in r[1]})
        parts = ", ".join(
            f"{k} {statistics.median(r[1].get(k, 0.0) for r in rows) * 1e3:.2f}" for k in phases
        )
        gpu_copy = statistics.median(r[2] for r in rows)
        segs = sum(r[3] for r in rows)
        print(
            f"  {name:14s} {whole:8.2f} ms  {ratio:.3f}x copy | {parts} | copy on GPU {gpu_copy:.2f} ms | new segments {segs}"
        )
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for name in ("copy", "check"):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(2):
                    run(name)
            print(f"== profile: {name} (2 iterations)")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=18))


def _copy(
    summed: Manifest, plain: Manifest, store: HeldStore, pool: BufferPool, dev: torch.device, side: Any
) -> Sample:
    s = fragments.fetch_sample(store, plain, retry_max_wait_s=5, remove=False, pool=pool)
    s.device_copy = s.copy_to(dev)
    return s


def _check(
    summed: Manifest, plain: Manifest, store: HeldStore, pool: BufferPool, dev: torch.device, side: Any
) -> Sample:
    return fragments.fetch_sample(store, summed, retry_max_wait_s=5, remove=False, pool=pool, device=dev)


def _check_current(
    summed: Manifest, plain: Manifest, store: HeldStore, pool: BufferPool, dev: torch.device, side: Any
) -> Sample:
    with _check_stream_is_current(dev):
        return _check(summed, plain, store, pool, dev, side)


def _copy_side(
    summed: Manifest, plain: Manifest, store: HeldStore, pool: BufferPool, dev: torch.device, side: Any
) -> Sample:
    s = fragments.fetch_sample(store, plain, retry_max_wait_s=5, remove=False, pool=pool)
    with torch.cuda.stream(side):
        s.device_copy = s.copy_to(dev)
    side.synchronize()
    s.device_copy.used_on(torch.cuda.current_stream(dev))
    return s


def _copy_sum(
    summed: Manifest, plain: Manifest, store: HeldStore, pool: BufferPool, dev: torch.device, side: Any
) -> Sample:
    s = fragments.fetch_sample(store, plain, retry_max_wait_s=5, remove=False, pool=pool)
    s.device_copy = s.copy_to(dev)
    views = dict(s.device_copy.destinations())
    devsum.digests8([views[f.key] for f in plain.data_objects])
    return s


ARMS: dict[str, Callable[..., Sample]] = {
    "copy": _copy,
    "check": _check,
    "check_current": _check_current,
    "copy_side": _copy_side,
    "copy_sum": _copy_sum,
}

if __name__ == "__main__":
    main()
