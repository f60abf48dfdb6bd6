"""The host's checksum: fragments, loss masks, spool shards and checkpoint files. (The stages of a
CUDA engine sum their fragments on the GPU instead, and a CUDA trainer checks them there:
`hpctoolkit.integrity.devsum`.)

A digest is `"<algorithm>:<hex>"`, so a record names how it was computed and a reader never
guesses. The algorithm is xxHash's XXH3-64 (`xxhash`, installed with `datasets`, a declared
dependency): it detects corruption, not tampering, which is what a store or a disk needs here.

Measured 2026-12-04 on this machine (one core, 7 runs each, median throughput):

    .venv/bin/python -c '...zlib.crc32 / zlib.adler32 / hashlib.blake2b / sha256 / xxhash.xxh3_64...'
    buffer   crc32      adler32    blake2b    sha256     xxh3_64
    1 MiB    4.2 GB/s   3.7 GB/s   0.95 GB/s  1.8 GB/s   61 GB/s
    16 MiB   4.1 GB/s   3.6 GB/s   0.70 GB/s  1.8 GB/s   40 GB/s
    64 MiB   4.2 GB/s   3.6 GB/s   0.94 GB/s  1.8 GB/s   23 GB/s

XXH3 is 5-10x crc32 (zlib 1.2.13 here) and at about the memory bandwidth of this host, so no
function could make a separate pass much cheaper. Its cost on the fragment path (2026-12-06: the
fetch 1.05x on the 2-core host, 1.07x-1.15x on an H100 node's 16-core host; the 3 % goal is not
met) is in `benchmarks/store_path.py`'s docstring. The standard library plus `xxhash` (torch only inside the tensor helpers): no store.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

ALGORITHM = "xxh3_64"
CHUNK_BYTES = 16 << 20
# Hashing threads of a process (`digests8_async`): xxhash releases the GIL while it hashes, so they
# run beside the thread that puts or gets the bytes. Hashing is memory-bound: on a 16-core Xeon
# host (2026-12-05) 280 MiB took 25.9 ms on one thread, 14.9 on 4, 10.6 on 8 and 12.6 on 16.
MAX_HASH_THREADS = 8

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def digest(*buffers: Any) -> str:
    """The digest of `buffers` (anything with the buffer protocol: bytes, a contiguous numpy array,
    a memoryview), as if concatenated."""
    import xxhash

    h = xxhash.xxh3_64()
    for buf in buffers:
        h.update(memoryview(buf).cast("B"))
    return f"{ALGORITHM}:{h.hexdigest()}"


def tensor_digest(t: Any) -> str:
    """The digest of a contiguous CPU tensor's bytes (any dtype: read as bytes)."""
    return digest(_tensor_bytes(t))


def tensor_digest8(t: Any) -> bytes:
    """The 8-byte little-endian form of `tensor_digest` (what a stage's sums object holds)."""
    import xxhash

    return xxhash.xxh3_64_digest(_tensor_bytes(t))[::-1]


def _hash_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            workers = max(1, min(MAX_HASH_THREADS, os.cpu_count() or 1))
            _pool = ThreadPoolExecutor(workers, thread_name_prefix="hpctoolkit-checksum")
        return _pool


def digests8_async(tensors: Sequence[Any]) -> list[Future[bytes]]:
    """`tensor_digest8` of each of `tensors`, computed on the hashing threads: the caller moves the
    same bytes meanwhile (a store put reads them too) and takes each `.result()` when it needs the
    digests. The tensors must not change until then."""
    pool = _hash_pool()
    return [pool.submit(tensor_digest8, t) for t in tensors]


def digests8(tensors: Sequence[Any]) -> list[bytes]:
    """`tensor_digest8` of each of `tensors`, on the hashing threads in parallel."""
    if len(tensors) <= 1:
        return [tensor_digest8(t) for t in tensors]
    return [f.result() for f in digests8_async(tensors)]


def digest8_text(raw: bytes) -> str:
    """`tensor_digest8`'s bytes in the `"<algorithm>:<hex>"` form."""
    return f"{ALGORITHM}:{raw[::-1].hex()}"


def _tensor_bytes(t: Any) -> Any:
    # uint8 view first: numpy has no bfloat16.
    return t.reshape(-1).view(dtype=_uint8()).numpy()


def _uint8() -> Any:
    import torch

    return torch.uint8


def file_digest(path: str | os.PathLike[str]) -> str:
    """The digest of a file's bytes (read in chunks)."""
    import xxhash

    h = xxhash.xxh3_64()
    with Path(path).open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return f"{ALGORITHM}:{h.hexdigest()}"


def matches(expected: str, *buffers: Any) -> bool:
    """Whether `buffers` have the digest `expected` (False for an algorithm this package lacks)."""
    algo = expected.partition(":")[0]
    return algo == ALGORITHM and digest(*buffers) == expected


def files_record(paths: Iterable[Path], root: Path) -> dict[str, dict[str, Any]]:
    """`{relative name: {"bytes", "digest"}}` of `paths` (files under `root`)."""
    return {
        str(p.relative_to(root)): {"bytes": p.stat().st_size, "digest": file_digest(p)} for p in sorted(paths)
    }


def check_files(record: dict[str, dict[str, Any]], root: Path, names: Iterable[str]) -> str | None:
    """Why the files `names` of `record` (under `root`) do not match it, or None when they do."""
    for name in names:
        want = record[name]
        p = root / name
        if not p.is_file():
            return f"{name} is missing"
        size = p.stat().st_size
        if size != want["bytes"]:
            return f"{name} holds {size} bytes, {want['bytes']} were written"
        if file_digest(p) != want["digest"]:
            return f"{name} does not match its checksum"
    return None
