"""What the GPU's checksum (`hpctoolkit.integrity.devsum`, WMIX64) costs on one sample's bytes.

    python benchmarks/device_checksum.py [--mib 280] [--iters 20]

The fragment path's checksums are XXH3 on the host: 5.6-7 ms of the reader's 65-74 ms fetch of a
280 MiB sample on the H100 node's 16-core host, so no host pass meets 3 %. The trainer copies every
sample to its GPU anyway, and the engine gathers its rows on the GPU before its own copy to the
host. This script times `devsum.digests8` on one sample's bytes on the GPU, as torch ops (chunked)
and as its fused Triton kernel, and prints beside them the host-to-device copy of the same bytes
from pinned memory. It checks that the host, torch on CUDA and Triton agree.

Measured 2026-12-06 on one H100 80GB HBM3 (`$HPC/venv/bin/python benchmarks/device_checksum.py`,
the wheelhouse venv of `benchmarks/gpu_node.sh`), with this script's own copy of the kernel that
`hpctoolkit/integrity/devsum.py` then took over: host, torch on CUDA and Triton agree.

    280 MiB, medians of 20
      host-to-device copy (pinned) :    5.31 ms
      device-to-device copy        :    0.21 ms
      sum, torch ops (chunked)     :    6.41 ms
      sum, one Triton kernel       :    0.15 ms
      sum, torch ops on the host   :  475.78 ms (16 cores; XXH3 on 8 hashing threads: 5.6 ms)

So on the device the check costs 3 % of the copy that brings the sample there, and 0.2 % of the
65 ms fetch. It pays only where the trainer collates from the device copy it checked (the host's
collate copy then goes too), as `fetch_sample(device=...)` and `collate` do; a copy made only to
check would add its 5.3 ms to the fetch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpctoolkit.integrity import devsum


def _time(fn, iters: int) -> float:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def _torch_ops(t: torch.Tensor) -> list[bytes]:
    kernel = devsum._kernel
    devsum._kernel = False  # no Triton: torch's chunked ops on the GPU
    try:
        return devsum.digests8([t])
    finally:
        devsum._kernel = kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=280)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    n = a.mib * (1 << 20) // 4
    host = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32).pin_memory()
    dev = host.to("cuda")
    small = host[: 1 << 20].clone()
    ref = devsum.reference_digest8(small.numpy().tobytes())
    assert devsum.digests8([small]) == [ref], "the host's torch path differs from the definition"
    assert _torch_ops(small.cuda()) == [ref], "torch on CUDA differs from the definition"
    assert devsum.digests8([small.cuda()]) == [ref], "Triton differs from the definition"
    assert devsum.digests8([dev]) == _torch_ops(dev), "Triton differs from torch over the whole sample"
    buf = torch.empty_like(dev)
    print(f"{a.mib} MiB, medians of {a.iters}, {torch.cuda.get_device_name()}")
    print(
        f"  host-to-device copy (pinned) : {_time(lambda: buf.copy_(host, non_blocking=True), a.iters):7.2f} ms"
    )
    print(f"  device-to-device copy        : {_time(lambda: buf.copy_(dev), a.iters):7.2f} ms")
    print(f"  sum, torch ops (chunked)     : {_time(lambda: _torch_ops(dev), a.iters):7.2f} ms")
    print(f"  sum, one Triton kernel       : {_time(lambda: devsum.digests8([dev]), a.iters):7.2f} ms")
    t0 = time.perf_counter()
    devsum.digests8([host[: n // 4]])
    print(f"  sum, torch ops on the host   : {(time.perf_counter() - t0) * 4e3:7.2f} ms (a quarter, x4)")


if __name__ == "__main__":
    main()
