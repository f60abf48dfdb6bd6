"""Offline shards: samples saved to safetensors, and replayed through the same dataset path.

Layout of `out_dir`
    `shard-00000.safetensors`, ...: each holds whole samples, one tensor per store object under the
    object's own key (`<key>_input_ids`, `<key>_layer<id>`), and the samples' manifests as JSON in
    the safetensors metadata (`hpctoolkit.manifests`, a list in write order). Each saved manifest
    carries every object's checksum (`FragmentSpec.digest`, from the bytes written; the store's
    per-stage sums objects are not saved), and the reader checks each object it reads against
    it, refusing a mismatch with a `DataIntegrityError` naming the object and the shard.
    `index.json`: `{"format", "shards": [{"file", "samples", "nbytes"}], "num_samples"}`. Shards
    and the index are written atomically (`rundir.atomic`), and the index is rewritten
    after every shard, so a crash leaves an index that names only complete shards.

`ShardReader` is an `ObjectStore` (read-only; `remove` is a no-op) plus a manifest source, so
`HiddenStateDataset(reader.manifests(), reader, ...)` replays shards with the same checks as
training online. Reads go from the file straight into the sample's buffer (`readinto`).
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hpctoolkit import checksum
from hpctoolkit.capture.manifest import MANIFEST_SCHEMA_VERSION, UNSUMMED_SCHEMA_VERSION, Manifest
from hpctoolkit.data.dataset import HiddenStateDataset
from hpctoolkit.data.sample import Sample
from hpctoolkit.dtypes import safetensors_code
from hpctoolkit.errors import DataIntegrityError, StoreError
from hpctoolkit.rundir.atomic import atomic_path, write_json_atomic
from hpctoolkit.store.api import MissingKeysError

INDEX_NAME = "index.json"
FORMAT = "hpctoolkit-hidden-states-v1"
MANIFESTS_META = "hpctoolkit.manifests"


def _write_safetensors(path: Path, tensors: Sequence[tuple[str, torch.Tensor]], meta: dict[str, str]) -> None:
    # Not synced here: callers write to `rundir.atomic.atomic_path`, which syncs before the rename.
    # Written by hand rather than with safetensors.save_file: a sample's tensors are views into one
    # buffer, which save_file refuses (shared memory), and cloning them would copy every sample.
    header: dict[str, Any] = {"__metadata__": meta}
    offset = 0
    for name, t in tensors:
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": safetensors_code(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in tensors:
            # ndarray has the buffer protocol; numpy's stubs do not declare it for Python 3.11.
            f.write(memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()))  # type: ignore[arg-type]


class ShardWriter:
    """Append samples; a shard is closed when the next sample would take it past `max_shard_bytes`.

    A single sample larger than `max_shard_bytes` gets a shard of its own. Call `close()` (or use
    it as a context manager) to write the last shard.
    """

    def __init__(self, out_dir: str | os.PathLike[str], max_shard_bytes: int = 1 << 30):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: list[Sample] = []
        self._pending_bytes = 0
        self._shards: list[dict[str, Any]] = []
        self._keys: set[str] = set()
        index = self.out_dir / INDEX_NAME
        if index.exists():
            # Appending to an existing directory keeps what is there.
            data = json.loads(index.read_text())
            self._shards = list(data["shards"])
            self._keys = {k for s in self._shards for k in s["samples"]}

    def add(self, sample: Sample) -> None:
        if sample.key in self._keys:
            raise DataIntegrityError(f"sample {sample.key!r} is already in {self.out_dir}")
        nbytes = sample.manifest.nbytes
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self._pending.append(sample)
        self._pending_bytes += nbytes
        self._keys.add(sample.key)

    def flush(self) -> None:
        if not self._pending:
            return
        name = f"shard-{len(self._shards):05d}.safetensors"
        tensors = [kt for s in self._pending for kt in s.destinations()]
        manifests = [_summed_manifest(s).to_dict() for s in self._pending]
        meta = {MANIFESTS_META: json.dumps(manifests), "format": FORMAT}
        with atomic_path(self.out_dir / name) as tmp:
            _write_safetensors(tmp, tensors, meta)
        self._shards.append(
            {"file": name, "samples": [s.key for s in self._pending], "nbytes": self._pending_bytes}
        )
        self._write_index()
        self._pending, self._pending_bytes = [], 0

    def _write_index(self) -> None:
        index = {
            "format": FORMAT,
            "shards": self._shards,
            "num_samples": sum(len(s["samples"]) for s in self._shards),
        }
        write_json_atomic(self.out_dir / INDEX_NAME, index, indent=1)

    def close(self) -> None:
        self.flush()
        if not self._shards:
            self._write_index()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # On an exception the pending samples are dropped rather than half-written; the index
        # still names only complete shards.
        if exc_type is None:
            self.close()


def _summed_manifest(sample: Sample) -> Manifest:
    """The sample's manifest as a shard keeps it: every object with the digest of its bytes here
    (a sample read through a schema-1 manifest gets them too), no sums objects. An object the
    reader checked keeps the digest it computed (`Sample.checked`); the others are hashed all at
    once, on the hashing threads."""
    import dataclasses

    m = sample.manifest
    views = dict(sample.destinations())
    raw = dict(sample.checked)
    todo = [spec.key for spec in m.data_objects if spec.key not in raw]
    raw.update(zip(todo, checksum.digests8([views[k] for k in todo]), strict=True))
    known = {spec.key: checksum.digest8_text(raw[spec.key]) for spec in m.data_objects}

    def summed(spec: Any) -> Any:
        return dataclasses.replace(spec, digest=known[spec.key])

    return dataclasses.replace(
        m,
        input_ids=summed(m.input_ids),
        fragments=tuple(summed(f) for f in m.fragments),
        loss_mask=None if m.loss_mask is None else summed(m.loss_mask),
        sums=(),
        schema_version=MANIFEST_SCHEMA_VERSION,
    )


def keep_first(out_dir: str | os.PathLike[str], n: int) -> tuple[int, int]:
    """Cut a shard directory to its first `n` samples (whole shards: the later shards' files go,
    then the index names only the rest); `(samples, bytes)` kept. A resumed replay spool keeps what
    its checkpoint trained on. Raises when it holds fewer, or `n` falls inside a shard."""
    out = Path(out_dir)
    index = out / INDEX_NAME
    shards = json.loads(index.read_text())["shards"] if index.exists() else []
    kept: list[dict[str, Any]] = []
    count = 0
    for shard in shards:
        if count >= n:
            break
        kept.append(shard)
        count += len(shard["samples"])
    if count != n:
        raise DataIntegrityError(
            f"{out} holds {count} samples in whole shards up to sample {n} "
            f"({sum(len(s['samples']) for s in shards)} in all): it cannot be cut to the first {n}"
        )
    write_json_atomic(index, {"format": FORMAT, "shards": kept, "num_samples": count}, indent=1)
    for shard in shards[len(kept) :]:
        (out / shard["file"]).unlink(missing_ok=True)
    return count, sum(int(s["nbytes"]) for s in kept)


def _read_header(path: Path) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise DataIntegrityError(f"shard {path} is truncated (no header)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    return 8 + n, header


class ShardReader:
    """Offline shards as an `ObjectStore` and a manifest source; see the module docstring."""

    # `get_into` checks every object against the digest saved with it, naming its shard file, so
    # `fetch_sample` does not hash the same bytes a second time against the manifest's copy.
    checks_own_digests = True

    def __init__(self, shard_dir: str | os.PathLike[str]):
        self.dir = Path(shard_dir)
        index_path = self.dir / INDEX_NAME
        if not index_path.exists():
            raise DataIntegrityError(f"{self.dir} has no {INDEX_NAME}")
        index = json.loads(index_path.read_text())
        if index.get("format") != FORMAT:
            raise DataIntegrityError(f"{index_path}: format {index.get('format')!r}, expected {FORMAT!r}")
        self._objects: dict[str, tuple[Path, int, int]] = {}
        self._digests: dict[str, str] = {}
        self._manifests: list[dict[str, Any]] = []
        for shard in index["shards"]:
            path = self.dir / shard["file"]
            base, header = _read_header(path)
            meta = header.pop("__metadata__", {}) or {}
            manifests = json.loads(meta.get(MANIFESTS_META, "[]"))
            if [m.get("sample_key") for m in manifests] != shard["samples"]:
                raise DataIntegrityError(f"shard {path}: its manifests disagree with {INDEX_NAME}")
            self._manifests.extend(manifests)
            for m in manifests:
                if m.get("schema_version") == UNSUMMED_SCHEMA_VERSION:
                    continue  # saved before the checksums: sizes only
                objects = [m.get("input_ids"), *(m.get("fragments") or []), m.get("loss_mask")]
                self._digests.update({o["key"]: o["digest"] for o in objects if o and o.get("digest")})
            for key, info in header.items():
                begin, end = info["data_offsets"]
                self._objects[key] = (path, base + begin, end - begin)
        self._lock = threading.Lock()

    def manifests(self) -> list[dict[str, Any]]:
        """Manifest dicts in write order (parsed and validated by the dataset)."""
        return list(self._manifests)

    def __len__(self) -> int:
        return len(self._manifests)

    def __getitem__(self, index: int) -> Sample:
        """Sample `index` in write order, read through the same fetch path as the live store."""
        from hpctoolkit.capture import Manifest
        from hpctoolkit.store.fragments import fetch_sample

        return fetch_sample(
            self, Manifest.from_dict(self._manifests[index]), retry_max_wait_s=0.0, remove=False
        )

    def dataset(self, **kwargs: Any) -> HiddenStateDataset:
        """A `HiddenStateDataset` replaying these shards (sharding/resume kwargs as online)."""
        kwargs.setdefault("retry_max_wait_s", 0.0)
        return HiddenStateDataset(self.manifests(), self, **kwargs)

    # -- ObjectStore -----------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        raise StoreError(f"offline shards in {self.dir} are read-only")

    def get_into(self, keys: Sequence[str], dests: Sequence[torch.Tensor]) -> None:
        missing = [k for k in keys if k not in self._objects]
        if missing:
            raise MissingKeysError(missing)
        with self._lock:
            for key, dst in zip(keys, dests, strict=True):
                path, offset, size = self._objects[key]
                want = dst.numel() * dst.element_size()
                if size != want:
                    raise StoreError(f"object {key!r} holds {size} bytes, destination expects {want}")
                if not dst.is_contiguous() or dst.device.type != "cpu":
                    raise StoreError(f"object {key!r}: destination must be contiguous CPU memory")
                view = memoryview(dst.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]  # buffer protocol
                with open(path, "rb") as f:
                    f.seek(offset)
                    got = f.readinto(view)
                if got != size:
                    raise StoreError(f"object {key!r}: shard {path} is truncated ({got} of {size} bytes)")
        # Every object with a saved digest, all at once on the hashing threads (a replayed sample's
        # only check of them: `checks_own_digests`).
        summed = [(k, d) for k, d in zip(keys, dests, strict=True) if k in self._digests]
        got_digests = checksum.digests8([d.reshape(-1) for _, d in summed])
        for (key, _), raw in zip(summed, got_digests, strict=True):
            if checksum.digest8_text(raw) != self._digests[key]:
                raise DataIntegrityError(
                    f"object {key!r} in shard {self._objects[key][0]}: its bytes do not match the "
                    "checksum saved with it"
                )

    def exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self._objects for k in keys]

    def remove(self, keys: Sequence[str]) -> None:
        # Replay never deletes training data.
        pass

    def close(self) -> None:
        pass


def save_manifest_samples(
    samples: Sequence[Sample] | Any, out_dir: str | os.PathLike[str], max_shard_bytes: int = 1 << 30
) -> int:
    """Write every sample of an iterable (e.g. a `HiddenStateDataset`) to shards; return the count."""
    n = 0
    with ShardWriter(out_dir, max_shard_bytes) as w:
        for s in samples:
            w.add(s)
            n += 1
    return n
