"""What a checksum computed on the GPU would cost, for issue 28's 3 % goal (not built; measured).

    python benchmarks/device_checksum.py [--mib 280] [--iters 20]

The fragment path's checksums are XXH3 on the host: 5.6-7 ms of the reader's 65-74 ms fetch of a
280 MiB sample on the H100 node's 16-core host, so no host pass meets 3 %. The trainer copies every
sample to its GPU anyway, and the engine gathers its rows on the GPU before its own copy to the
host. This script times, on one sample's bytes on the GPU, a position-keyed sum of mixed 32-bit
words (a candidate that any device and the host compute alike: integer arithmetic modulo 2^64 is
order-free), as torch ops (chunked) and as one fused Triton kernel, and prints beside them the
host-to-device copy of the same bytes from pinned memory. It checks that the host, torch on CUDA
and Triton agree, and that one flipped bit and one swapped pair of words change the sum.

Measured 2026-12-06 on one H100 80GB HBM3 (`$HPC/venv/bin/python benchmarks/device_checksum.py`,
the wheelhouse venv of `benchmarks/gpu_node.sh`): host, torch on CUDA and Triton agree.

    280 MiB, medians of 20
      host-to-device copy (pinned) :    5.31 ms
      device-to-device copy        :    0.21 ms
      sum, torch ops (chunked)     :    6.41 ms
      sum, one Triton kernel       :    0.15 ms
      sum, torch ops on the host   :  475.78 ms (16 cores; XXH3 on 8 hashing threads: 5.6 ms)

So on the device the check costs 3 % of the copy that brings the sample there, and 0.2 % of the
65 ms fetch. It pays only if the trainer collates from the device copy it checked (the host's
collate copy then goes too); a copy made only to check would add its 5.3 ms to the fetch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

K1 = 0x9E3779B97F4A7C15 - (1 << 64)  # odd, as int64
K2 = 0xC2B2AE3D27D4EB4F - (1 << 64)
K3 = 0x165667B19E3779F9
M29 = (1 << 35) - 1
M32 = (1 << 32) - 1
CHUNK = 1 << 24  # words per torch pass


def wsum_torch(words: torch.Tensor) -> int:
    """Sum over i of mix(word_i, i) mod 2^64; `words` int32, 1-D, any device."""
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    for s in range(0, words.numel(), CHUNK):
        w = words[s : s + CHUNK].to(torch.int64) & M32
        i = torch.arange(s, s + w.numel(), dtype=torch.int64, device=words.device)
        z = w * K1 + i * K2
        z ^= (z >> 29) & M29
        z *= K3
        z ^= (z >> 32) & M32
        acc += z.sum()
    return int(acc)


def _triton_sum():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, out_ptr, n, block: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * block + tl.arange(0, block)
        m = offs < n
        w = tl.load(x_ptr + offs, mask=m, other=0).to(tl.uint32).to(tl.uint64)
        z = w * 0x9E3779B97F4A7C15 + offs.to(tl.uint64) * 0xC2B2AE3D27D4EB4F
        z = z ^ (z >> 29)
        z = z * 0x165667B19E3779F9
        z = z ^ (z >> 32)
        z = tl.where(m, z, 0)
        tl.store(out_ptr + pid, tl.sum(z, axis=0).to(tl.int64, bitcast=True))

    def run(words: torch.Tensor) -> int:
        block = 4096
        n = words.numel()
        grid = (n + block - 1) // block
        out = torch.empty(grid, dtype=torch.int64, device=words.device)
        kernel[(grid,)](words, out, n, block=block)
        return int(out.sum())

    return run


def _time(fn, iters: int) -> float:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=280)
    ap.add_argument("--iters", type=int, default=20)
    a = ap.parse_args()
    n = a.mib * (1 << 20) // 4
    host = torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32).pin_memory()
    dev = host.to("cuda")
    small = host[: 1 << 20].clone()
    ref = wsum_torch(small)
    tri = _triton_sum()
    assert wsum_torch(small.to("cuda")) == ref, "torch on CUDA differs from the host"
    assert tri(small.to("cuda")) == ref, "Triton differs from the host"
    flipped = small.clone()
    flipped[12345] ^= 1 << 17
    swapped = small.clone()
    swapped[[7, 8]] = swapped[[8, 7]]
    assert wsum_torch(flipped) != ref and wsum_torch(swapped) != ref
    assert tri(dev) == wsum_torch(dev), "Triton differs from torch over the whole sample"
    buf = torch.empty_like(dev)
    print(f"{a.mib} MiB, medians of {a.iters}, {torch.cuda.get_device_name()}")
    print(
        f"  host-to-device copy (pinned) : {_time(lambda: buf.copy_(host, non_blocking=True), a.iters):7.2f} ms"
    )
    print(f"  device-to-device copy        : {_time(lambda: buf.copy_(dev), a.iters):7.2f} ms")
    print(f"  sum, torch ops (chunked)     : {_time(lambda: wsum_torch(dev), a.iters):7.2f} ms")
    print(f"  sum, one Triton kernel       : {_time(lambda: tri(dev), a.iters):7.2f} ms")
    t0 = time.perf_counter()
    wsum_torch(host[: n // 4])
    print(f"  sum, torch ops on the host   : {(time.perf_counter() - t0) * 4e3:7.2f} ms (a quarter, x4)")


if __name__ == "__main__":
    main()
