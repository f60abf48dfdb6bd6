"""WMIX64: the checksum a CUDA engine and a CUDA trainer compute on their GPUs, where the bytes are.

XXH3 (`hpctoolkit.integrity.checksum`) is a host pass over every byte: 5.6 ms of a 65 ms fetch of a 280 MiB
sample on the H100 node's 16-core host (2026-12-06), and no host pass meets the 3 % goal. Both ends
of the fragment path have the bytes on a GPU anyway: the engine gathers its rows there before its
copy to the host, and the trainer copies every sample to its device. There one fused Triton kernel
sums the same 280 MiB in 0.15 ms, against 5.3 ms for the copy (`benchmarks/device_checksum.py`).

The sum. An object's bytes are read as little-endian 32-bit words `w_i` (a last partial word is
padded with zeros); each word is mixed with its index, and the results are added modulo 2^64:

    z_i = w_i * K1 + i * K2;  z_i ^= z_i >> 29;  z_i *= K3;  z_i ^= z_i >> 32
    digest = (sum_i z_i + nbytes * K2) mod 2^64, as 8 little-endian bytes

(unsigned 64-bit arithmetic, logical shifts). Addition modulo 2^64 does not depend on the order of
the terms, so a GPU's reduction, torch's on the host and the kernel agree bit for bit (tested).
Each step of the mix is a bijection of `w_i` for a given `i`, so any change to one word changes
the digest; a swap of two words changes it unless their mixes collide (about 2^-64). It guards
against transport and storage faults, not against an adversary.

`digests8` runs on the tensors' device: one Triton kernel per object on CUDA (chunked torch ops
where Triton is missing), chunked torch ops on the host (slow: about 0.5 s for 280 MiB on 16 cores;
a host reads XXH3 sums instead, see `hpctoolkit.store.fragments`). Torch only; no store.

On the fragment path (one H100 node, 2026-12-06, `benchmarks/store_path.py --device cuda --iters
15`, 280 MiB samples, medians of paired ratios against the same path without sums): publish
1.013x, fetch to the GPU 1.005x, roundtrip 1.006x. The reader's check, copy and sums on its own
stream, took 5.81 ms where the plain copy took 5.44 ms; the sums alone 0.48-0.91 ms (six objects,
launches included). (A first figure, fetch 1.125x, was the benchmark freeing another arm's buffer
inside this arm's timing.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

ALGORITHM = "wmix64"
DIGEST_BYTES = 8
K1 = 0x9E3779B97F4A7C15
K2 = 0xC2B2AE3D27D4EB4F
K3 = 0x165667B19E3779F9
_M64 = (1 << 64) - 1
# Words per torch pass (the reference): bounds its int64 temporaries to 128 MiB each.
_CHUNK = 1 << 24
_BLOCK = 4096


def _signed(v: int) -> int:
    """`v` modulo 2^64 as a two's-complement int64 (what torch's int64 arithmetic holds)."""
    v &= _M64
    return v - (1 << 64) if v >> 63 else v


_S1, _S2, _S3 = _signed(K1), _signed(K2), _signed(K3)


def _words(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(whole 32-bit words, the zero-padded last partial word or None, byte count) of `t`."""
    if not t.is_contiguous():
        raise ValueError(f"{ALGORITHM}: the tensor must be contiguous (shape {tuple(t.shape)})")
    raw = t.reshape(-1).view(torch.uint8)
    n = raw.numel()
    whole = n // 4 * 4
    try:
        words = raw[:whole].view(torch.int32)
    except RuntimeError:  # a view that starts off a 4-byte boundary: read it from a copy
        words = raw[:whole].clone().view(torch.int32)
    if whole == n:
        return words, None, n
    pad = torch.zeros(4, dtype=torch.uint8, device=raw.device)
    pad[: n - whole] = raw[whole:]
    return words, pad.view(torch.int32), n


def _mix_sum_torch(words: torch.Tensor, first_index: int) -> torch.Tensor:
    """The sum of the mixed `words` (int32, 1-D), the first at index `first_index`: int64 scalar."""
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    low35, low32 = (1 << 35) - 1, (1 << 32) - 1
    for s in range(0, words.numel(), _CHUNK):
        w = words[s : s + _CHUNK].to(torch.int64) & low32
        z = torch.arange(first_index + s, first_index + s + w.numel(), dtype=torch.int64, device=words.device)
        z *= _S2
        z += w * _S1
        z ^= (z >> 29) & low35  # a logical shift of the int64's bits
        z *= _S3
        z ^= (z >> 32) & low32
        acc += z.sum()
    return acc


_kernel: Any = None


def _triton_kernel() -> Any:
    """The fused kernel (compiled on first use), or None where Triton is missing."""
    global _kernel
    if _kernel is None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _kernel = False
            return None

        @triton.jit
        def mix_sum(x_ptr, out_ptr, n, block: tl.constexpr):  # pragma: no cover (GPU only)
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

        _kernel = mix_sum
    return _kernel or None


def _mix_sum(words: torch.Tensor) -> torch.Tensor:
    if words.device.type == "cuda" and words.numel() and (kernel := _triton_kernel()) is not None:
        grid = -(-words.numel() // _BLOCK)
        out = torch.empty(grid, dtype=torch.int64, device=words.device)
        kernel[(grid,)](words, out, words.numel(), block=_BLOCK)
        return out.sum()
    return _mix_sum_torch(words, 0)


def digest_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t`'s digest as an int64 scalar on `t`'s device, queued on its current stream (no sync)."""
    words, tail, n = _words(t)
    acc = _mix_sum(words)
    if tail is not None:
        acc = acc + _mix_sum_torch(tail, words.numel())
    return acc + _signed(n * K2)


def digests8(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    """The 8-byte little-endian digest of each of `tensors` (contiguous, any dtype); where they
    are on a GPU, one wait for all of them (on the current stream)."""
    if not tensors:
        return []
    values = torch.stack([digest_tensor(t).to(tensors[0].device) for t in tensors]).cpu()
    return [int(v).to_bytes(DIGEST_BYTES, "little", signed=True) for v in values.tolist()]


def reference_digest8(data: bytes) -> bytes:
    """The digest of `data` in plain Python integers: the definition the tensor paths are tested
    against (slow; for tests)."""
    n = len(data)
    padded = data + b"\0" * (-n % 4)
    acc = 0
    for i in range(len(padded) // 4):
        w = int.from_bytes(padded[4 * i : 4 * i + 4], "little")
        z = (w * K1 + i * K2) & _M64
        z ^= z >> 29
        z = (z * K3) & _M64
        z ^= z >> 32
        acc += z
    return ((acc + n * K2) & _M64).to_bytes(DIGEST_BYTES, "little")
