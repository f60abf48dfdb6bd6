"""Offline shards: samples saved to safetensors, and replayed through the same dataset path.

Layout of `out_dir`
    `shard-00000.safetensors`, ...: each holds whole samples, one tensor per store object under the
    object's own key (`<key>_input_ids`, `<key>_layer<id>`), and the samples' manifests as JSON in
    the safetensors metadata (`hpctoolkit.manifests`, a list in write order). Each saved manifest
    carries every object's checksum (`FragmentSpec.digest`, from the bytes written; the store's
    per-stage sums objects are not saved), and the reader checks each object it reads against
    it, refusing a mismatch with a `DataIntegrityError` naming the object and the shard.
    `index.jsonl`: the index, appended to: a first line `{"format"}`, then one line per shard
    `{"file", "samples": [keys], "sizes": [bytes per sample], "nbytes"}`, appended (and synced)
    once the shard's file is complete. Shards are written atomically (`rundir.atomic`), so a crash
    leaves an index that names only complete shards; a line torn by the crash is not taken (and
    an appending writer first rewrites the index without it). The bytes the index takes per sample
    do not grow with the spool (the index of 2026-12-06 and before, `index.json`, was rewritten
    whole after every shard; it is still read, and converted when appended to).
    A line may name fewer samples than its shard file holds: `keep_first` cuts a spool to the
    samples a checkpoint trained on by shortening the last kept line, never by rewriting a shard.

Faults between and during attempts. A full disk while a shard or its index line is written is a
`rundir.atomic.DiskFullError` naming the file and the bytes it needed; the shard's temporary file
goes, a half-written index line is cut off, so the index still names only complete shards.
A shard the index names that is missing, or holds fewer bytes than its header's offsets of the
samples named (a node died mid-write, a scratch purge), is a `DataIntegrityError` naming it, found
when the spool is cut for a resume (`keep_first`) or opened for replay (`ShardReader`), before any
of its samples is read: a partial shard is never replayed.

`ShardReader` is an `ObjectStore` (read-only; `remove` is a no-op) plus a manifest source, so
`HiddenStateDataset(reader.manifests(), reader, ...)` replays shards with the same checks as
training online. Reads go from the file straight into the sample's buffer (`readinto`).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hpctoolkit.capture.manifest import MANIFEST_SCHEMA_VERSION, UNSUMMED_SCHEMA_VERSION, Manifest
from hpctoolkit.data.dataset import HiddenStateDataset
from hpctoolkit.data.sample import Sample
from hpctoolkit.dtypes import safetensors_code
from hpctoolkit.errors import DataIntegrityError, StoreError
from hpctoolkit.integrity import checksum
from hpctoolkit.rundir.atomic import atomic_path, disk_full, write_text_atomic
from hpctoolkit.store.api import MissingKeysError

INDEX_NAME = "index.jsonl"
# The whole-file index of 2026-12-06 and before: read, and converted when appended to.
LEGACY_INDEX_NAME = "index.json"
FORMAT = "hpctoolkit-hidden-states-v1"
MANIFESTS_META = "hpctoolkit.manifests"


def _safetensors_header(
    tensors: Sequence[tuple[str, torch.Tensor]], meta: dict[str, str]
) -> tuple[bytes, int]:
    """The header of a safetensors file of `tensors`, and the bytes of their data after it."""
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
    return raw + b" " * (-len(raw) % 8), offset


def _write_safetensors(path: Path, tensors: Sequence[tuple[str, torch.Tensor]], meta: dict[str, str]) -> None:
    # Not synced here: callers write to `rundir.atomic.atomic_path`, which syncs before the rename.
    # Written by hand rather than with safetensors.save_file: a sample's tensors are views into one
    # buffer, which save_file refuses (shared memory), and cloning them would copy every sample.
    raw, _ = _safetensors_header(tensors, meta)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in tensors:
            # ndarray has the buffer protocol; numpy's stubs do not declare it for Python 3.11.
            f.write(memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy()))  # type: ignore[arg-type]


def read_index(out_dir: str | os.PathLike[str]) -> tuple[list[dict[str, Any]], bool]:
    """The shards a directory's index names, in order, and whether its last line was torn (a
    crash while appending: that line is not taken). An empty list when there is no index."""
    out = Path(out_dir)
    path = out / INDEX_NAME
    if not path.exists():
        legacy = out / LEGACY_INDEX_NAME
        if not legacy.exists():
            return [], False
        data = json.loads(legacy.read_text())
        if data.get("format") != FORMAT:
            raise DataIntegrityError(f"{legacy}: format {data.get('format')!r}, expected {FORMAT!r}")
        return [_with_sizes(out, s) for s in data["shards"]], False
    raw = path.read_bytes()
    lines = raw.split(b"\n")
    torn = lines[-1] != b""  # a complete index ends in a newline
    lines = lines[:-1]
    if not lines:
        return [], torn
    head = json.loads(lines[0])
    if head.get("format") != FORMAT:
        raise DataIntegrityError(f"{path}: format {head.get('format')!r}, expected {FORMAT!r}")
    shards = []
    for n, line in enumerate(lines[1:], start=2):
        try:
            shards.append(json.loads(line))
        except ValueError as err:
            raise DataIntegrityError(f"{path}: line {n} is not JSON ({err})") from err
    return shards, torn


def _with_sizes(out: Path, shard: dict[str, Any]) -> dict[str, Any]:
    """A legacy index line, with the per-sample sizes read from its shard's manifests."""
    if "sizes" in shard:
        return shard
    _, header = _read_header(out / shard["file"])
    manifests = json.loads((header.get("__metadata__") or {}).get(MANIFESTS_META, "[]"))
    sizes = [Manifest.from_dict(m).nbytes for m in manifests][: len(shard["samples"])]
    return {**shard, "sizes": sizes}


def _index_text(shards: Sequence[dict[str, Any]]) -> str:
    lines = [json.dumps({"format": FORMAT})] + [json.dumps(s, separators=(",", ":")) for s in shards]
    return "".join(line + "\n" for line in lines)


def write_index(out_dir: str | os.PathLike[str], shards: Sequence[dict[str, Any]]) -> None:
    """Rewrite a directory's index whole, atomically (a cut, a conversion); appends are the
    writer's. A legacy `index.json` beside it goes."""
    out = Path(out_dir)
    write_text_atomic(out / INDEX_NAME, _index_text(shards))
    (out / LEGACY_INDEX_NAME).unlink(missing_ok=True)


class ShardWriter:
    """Append samples; a shard is closed when the next sample would take it past `max_shard_bytes`.

    A single sample larger than `max_shard_bytes` gets a shard of its own. Call `close()` (or use
    it as a context manager) to write the last shard. `flush()` closes the shard being filled now
    (a checkpoint's barrier: every sample added so far is then durable). Each shard costs one
    append to the index, whatever the spool's size (`index_bytes_written` counts them).
    """

    def __init__(self, out_dir: str | os.PathLike[str], max_shard_bytes: int = 1 << 30):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be > 0, got {max_shard_bytes}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_shard_bytes = max_shard_bytes
        self._pending: list[Sample] = []
        self._pending_bytes = 0
        # Appending to an existing directory keeps what its index names.
        shards, torn = read_index(self.out_dir)
        self._shards: list[dict[str, Any]] = shards
        self._keys: set[str] = {k for s in self._shards for k in s["samples"]}
        self.index_bytes_written = 0
        if torn or (self.out_dir / LEGACY_INDEX_NAME).exists() or not (self.out_dir / INDEX_NAME).exists():
            write_index(self.out_dir, self._shards)

    @property
    def samples_written(self) -> int:
        """Samples in complete shards the index names (durable)."""
        return sum(len(s["samples"]) for s in self._shards)

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
        raw, data_bytes = _safetensors_header(tensors, meta)
        with atomic_path(self.out_dir / name, nbytes=8 + len(raw) + data_bytes) as tmp:
            _write_safetensors(tmp, tensors, meta)
        shard = {
            "file": name,
            "samples": [s.key for s in self._pending],
            "sizes": [s.manifest.nbytes for s in self._pending],
            "nbytes": self._pending_bytes,
        }
        try:
            self._append_index(shard)
        except BaseException:
            (self.out_dir / name).unlink(missing_ok=True)  # named by no index line: its space back
            raise
        self._shards.append(shard)
        self._pending, self._pending_bytes = [], 0

    def _append_index(self, shard: dict[str, Any]) -> None:
        line = (json.dumps(shard, separators=(",", ":")) + "\n").encode()
        path = self.out_dir / INDEX_NAME
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                view = memoryview(line)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            except OSError as err:
                # A line cut short by a full disk is cut off: the index stays whole-lined.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, start)
                full = disk_full(err, path, len(line))
                if full is None:
                    raise
                raise full from err
        finally:
            os.close(fd)
        self.index_bytes_written += len(line)

    def close(self) -> None:
        self.flush()

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
    """Cut a shard directory to its first `n` samples; `(samples, bytes)` kept. A resumed replay
    spool keeps what its checkpoint trained on. The shard holding sample `n` keeps its file and
    its index line names only its first samples; the later shards' files go. Raises, naming the
    directory, when it holds fewer than `n`."""
    out = Path(out_dir)
    shards, _ = read_index(out)
    kept: list[dict[str, Any]] = []
    count = 0
    for shard in shards:
        if count >= n:
            break
        take = min(len(shard["samples"]), n - count)
        if take < len(shard["samples"]):
            sizes = list(shard["sizes"])[:take]
            kept.append({**shard, "samples": shard["samples"][:take], "sizes": sizes, "nbytes": sum(sizes)})
        else:
            kept.append(shard)
        count += take
    if count != n:
        raise DataIntegrityError(
            f"{out} holds {count} samples, fewer than the {n} its checkpoint trained on: "
            "it cannot be cut to them"
        )
    for shard in kept:
        try:
            _open_shard(out / shard["file"], shard["samples"])
        except DataIntegrityError as err:
            raise DataIntegrityError(
                f"{err}; its checkpoint trained on these samples and the store no longer holds "
                "them, so the spool cannot be resumed (none of it is replayed): run again in a "
                "fresh output_dir"
            ) from None
    write_index(out, kept)
    for shard in shards[len(kept) :]:
        (out / shard["file"]).unlink(missing_ok=True)
    return count, sum(int(s["nbytes"]) for s in kept)


def _read_header(path: Path) -> tuple[int, dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) != 8:
                raise DataIntegrityError(f"shard {path} is truncated (no header)")
            (n,) = struct.unpack("<Q", raw)
            if 8 + n > size:
                raise DataIntegrityError(
                    f"shard {path} is truncated ({size} bytes, its header alone takes {8 + n})"
                )
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise DataIntegrityError(f"shard {path} is missing (its directory's {INDEX_NAME} names it)") from None
    except ValueError as err:
        raise DataIntegrityError(f"shard {path}: its header is not JSON ({err})") from None
    return 8 + n, header


def _open_shard(
    path: Path, samples: Sequence[str]
) -> tuple[int, dict[str, Any], list[dict[str, Any]], set[str]]:
    """A shard's header (data offsets from the first returned value), the manifests of the
    samples its index line names (`samples`, its first ones) and their objects' keys, checked: the
    shard holds every byte of those objects. A shard removed, or truncated, is a
    `DataIntegrityError` naming it."""
    base, header = _read_header(path)
    meta = header.pop("__metadata__", {}) or {}
    # The index may name only the first samples of a shard (`keep_first`).
    manifests = json.loads(meta.get(MANIFESTS_META, "[]"))[: len(samples)]
    if [m.get("sample_key") for m in manifests] != list(samples):
        raise DataIntegrityError(f"shard {path}: its manifests disagree with {INDEX_NAME}")
    keys = {o["key"] for m in manifests for o in _objects_of(m)}
    missing = sorted(keys - header.keys())
    if missing:
        raise DataIntegrityError(
            f"shard {path} holds no object {missing[0]!r} of the samples {INDEX_NAME} names"
        )
    size = path.stat().st_size
    cut = sorted((base + int(header[k]["data_offsets"][1]), k) for k in keys)
    cut = [(end, k) for end, k in cut if end > size]
    if cut:
        end, key = cut[0]
        raise DataIntegrityError(
            f"object {key!r} in shard {path} is truncated: the shard holds {size} bytes, the object "
            f"ends at byte {end}"
        )
    return base, header, manifests, keys


def _objects_of(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """A saved manifest's data objects (its sums objects are never saved)."""
    objects = [manifest.get("input_ids"), *(manifest.get("fragments") or []), manifest.get("loss_mask")]
    return [o for o in objects if o]


class ShardReader:
    """Offline shards as an `ObjectStore` and a manifest source; see the module docstring."""

    # `get_into` checks every object against the digest saved with it, naming its shard file, so
    # `fetch_sample` does not hash the same bytes a second time against the manifest's copy.
    checks_own_digests = True

    def __init__(self, shard_dir: str | os.PathLike[str]):
        self.dir = Path(shard_dir)
        if not (self.dir / INDEX_NAME).exists() and not (self.dir / LEGACY_INDEX_NAME).exists():
            raise DataIntegrityError(f"{self.dir} has no {INDEX_NAME}")
        shards, _ = read_index(self.dir)
        self._objects: dict[str, tuple[Path, int, int]] = {}
        self._digests: dict[str, str] = {}
        self._manifests: list[dict[str, Any]] = []
        for shard in shards:
            # Every shard is checked whole before any sample is handed out.
            path = self.dir / shard["file"]
            base, header, manifests, keys = _open_shard(path, shard["samples"])
            self._manifests.extend(manifests)
            for m in manifests:
                if m.get("schema_version") == UNSUMMED_SCHEMA_VERSION:
                    continue  # saved before the checksums: sizes only
                self._digests.update({o["key"]: o["digest"] for o in _objects_of(m) if o.get("digest")})
            for key, info in header.items():
                if key in keys:
                    begin, end = info["data_offsets"]
                    self._objects[key] = (path, base + begin, end - begin)
        self._lock = threading.Lock()
        self._fds: dict[Path, int] = {}

    def _fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

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
        for key, dst in zip(keys, dests, strict=True):
            path, offset, size = self._objects[key]
            want = dst.numel() * dst.element_size()
            if size != want:
                raise StoreError(f"object {key!r} holds {size} bytes, destination expects {want}")
            if not dst.is_contiguous() or dst.device.type != "cpu":
                raise StoreError(f"object {key!r}: destination must be contiguous CPU memory")
            view = memoryview(dst.view(torch.uint8).reshape(-1).numpy())  # type: ignore[arg-type]  # buffer protocol
            # Positioned reads on one descriptor per shard: readers on several threads
            # (`data.prefetch`) share it without a lock around the reads.
            fd, got = self._fd(path), 0
            while got < size:
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    raise StoreError(f"object {key!r}: shard {path} is truncated ({got} of {size} bytes)")
                got += n
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
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


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
