"""Publishing a stage's fragments, and fetching a whole sample back: the manifest's two ends.

Publish (engine side, one call per pipeline stage per sample)
    `publish_stage` is given exactly the objects the manifest assigns to that stage: the capture ids
    the stage owns, plus `input_ids` on stage 0 only, each with the manifest's shape and dtype.
    Anything else raises `DataIntegrityError` before a byte is written; a store failure raises
    `StoreError`. Nothing is ever skipped with a warning. The stage's sums object (the checksum
    of each object it puts, `Manifest.summed`) is computed on the hashing threads while the
    objects are put (`checksum.digests8_async`), and put right after them.

Fetch (trainer side)
    `fetch_sample` allocates one buffer for the sample (`Sample.empty_for`, recycled through a
    `BufferPool` when given) and fills it with one batched zero-copy `get_into`. Keys that are not
    there yet are polled until `retry_max_wait_s`; then it raises `DataIntegrityError` naming
    them. A master that stopped answering, or a read that outlasted its lease
    (`TransientStoreError`), is retried within the same window and then re-raised. An object
    whose byte size differs from the manifest's shape and dtype raises at once, naming its key
    (objects carry no shape of their own, so a same-size transposition cannot be told apart).
    Every object is checked against its checksum before the sample is returned: its own `digest`
    in the manifest, or its stage's sums object, fetched in the same batch (`capture.manifest`).
    All of them are computed at once, on the hashing threads (`checksum.digests8_async`); a
    mismatch raises `DataIntegrityError` naming the object's key, once every thread is done with
    the buffer. A store whose `get_into` checks each object's own digest itself
    (`checks_own_digests`: offline shards, naming the shard file) is not hashed a second time. A schema-1 manifest (no checksums, written before 2026-12-04) is read with sizes
    checked only.
    `input_ids` are checked against `input_ids_sha256` and the caller's expected ids. After a
    successful read and its checks the sample's objects are force-removed (a read leaves a
    lease); "not found" counts as removed. A sample that fails is left in the store for
    inspection and never returned.

Loss mask (engine leader side)
    `publish_loss_mask` puts a sample's `[num_tokens]` uint8 mask under the key its manifest's
    `loss_mask` names (`capture.manifest.with_loss_mask`), after checking its shape and that it
    holds only 0 and 1, and that it matches the digest the manifest gives it. The reader fetches
    it with the sample's other objects and checks the same.

Manifest `extra` keys this module reads
    `input_ids_sha256` (`INPUT_IDS_SHA256`): hex SHA-256 of the sample's `input_ids` as
    little-endian int64 bytes (`input_ids_digest`). The engine sets it when it builds the manifest;
    stage 0 checks it before publishing and the reader checks it after fetching, so an `input_ids`
    object that belongs to another prompt is caught even when its length matches.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import wait

import torch

from hpctoolkit.capture.manifest import DIGEST_BYTES, FragmentSpec, Manifest
from hpctoolkit.data.sample import BufferPool, Sample
from hpctoolkit.dtypes import dtype_name
from hpctoolkit.errors import DataIntegrityError, StoreError
from hpctoolkit.integrity import checksum, devsum
from hpctoolkit.store.api import MissingKeysError, ObjectStore
from hpctoolkit.store.mooncake import StoreUnavailableError, TransientStoreError

INPUT_IDS_SHA256 = "input_ids_sha256"


def input_ids_digest(input_ids: torch.Tensor) -> str:
    """Hex SHA-256 of token ids as little-endian int64 bytes; the manifest's `input_ids_sha256`."""
    ids = input_ids.detach().to(device="cpu", dtype=torch.int64).contiguous().reshape(-1)
    return hashlib.sha256(ids.numpy().astype("<i8", copy=False).tobytes()).hexdigest()


def _check_tensor(manifest: Manifest, spec: FragmentSpec, t: torch.Tensor) -> None:
    where = f"sample {manifest.sample_key!r}, object {spec.key!r}"
    if not isinstance(t, torch.Tensor):
        raise DataIntegrityError(f"{where}: expected a tensor, got {type(t).__name__}")
    if tuple(t.shape) != spec.shape:
        raise DataIntegrityError(
            f"{where}: shape {list(t.shape)} differs from the manifest's {list(spec.shape)}"
        )
    if dtype_name(t.dtype) != spec.dtype:
        raise DataIntegrityError(
            f"{where}: dtype {dtype_name(t.dtype)} differs from the manifest's {spec.dtype}"
        )


def host_copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous host tensors of `tensors`: host ones as they are (made contiguous), GPU ones
    copied into page-locked memory, all queued on the current stream and waited for once.

    A CUDA stage's rows went to pageable memory before 2026-12-06 (`Tensor.to("cpu")`): on an H100
    node publishing 280 MiB from the GPU took 206-224 ms, against 34 ms from host tensors; through
    page-locked memory 59-62 ms (`benchmarks/store_path.py --device cuda`). Page-locked blocks come
    from torch's host allocator, which rounds each up to a power of two and keeps freed ones for
    the next sample: a stage's publisher thread keeps a few times its largest sample's rows pinned.
    """
    out = [t.detach() for t in tensors]
    devices = {t.device for t in out if t.device.type == "cuda"}
    for i, src in enumerate(out):
        if src.device.type == "cuda":
            out[i] = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            out[i].copy_(src, non_blocking=True)
        elif src.device.type != "cpu":
            out[i] = src.to("cpu")
    for device in devices:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
        done.synchronize()
    return [t.contiguous() for t in out]


def publish_stage(
    store: ObjectStore,
    manifest: Manifest,
    stage: int,
    layers: Mapping[int, torch.Tensor],
    input_ids: torch.Tensor | None,
    layer_digests: Mapping[int, bytes] | None = None,
) -> int:
    """Put the objects that `stage` owns for one sample; return the bytes published.

    `layers` maps capture id to a `[num_tokens, hidden_size]` tensor and must hold exactly the
    capture ids the manifest assigns to `stage`. `input_ids` (`[num_tokens]` int64) is required on
    stage 0 and must be None elsewhere. Tensors on another device, or not contiguous, are copied
    to contiguous CPU memory first. `layer_digests`: for a `wmix64` manifest, the checksums of
    (some of) `layers` by capture id, computed where the rows were (a CUDA engine's GPU, before its
    copy to the host); the others are computed here.
    """
    key = manifest.sample_key
    if not 0 <= stage < manifest.pp_size:
        raise DataIntegrityError(f"sample {key!r}: stage {stage} is outside [0, {manifest.pp_size})")
    want_layers = {
        k: f for f, k in zip(manifest.fragments, manifest.layer_ids, strict=True) if f.stage == stage
    }
    given = set(layers)
    if given != set(want_layers):
        missing = sorted(set(want_layers) - given)
        extra = sorted(given - set(want_layers))
        raise DataIntegrityError(
            f"sample {key!r}: stage {stage} must publish capture ids {sorted(want_layers)}, "
            f"got {sorted(given)} (missing {missing}, not owned {extra})"
        )
    items: list[tuple[str, torch.Tensor]] = []
    if stage == 0:
        if input_ids is None:
            raise DataIntegrityError(f"sample {key!r}: stage 0 must publish input_ids, got None")
        _check_tensor(manifest, manifest.input_ids, input_ids)
        want_sha = manifest.extra.get(INPUT_IDS_SHA256)
        if want_sha is not None and input_ids_digest(input_ids) != want_sha:
            raise DataIntegrityError(
                f"sample {key!r}, object {manifest.input_ids.key!r}: input_ids do not match the "
                f"manifest's {INPUT_IDS_SHA256}"
            )
        items.append((manifest.input_ids.key, input_ids))
    elif input_ids is not None:
        raise DataIntegrityError(
            f"sample {key!r}: only stage 0 publishes input_ids; stage {stage} was given them"
        )
    for layer_id, spec in want_layers.items():
        _check_tensor(manifest, spec, layers[layer_id])
        items.append((spec.key, layers[layer_id]))
    items = list(zip([k for k, _ in items], host_copies([t for _, t in items]), strict=True))
    if layer_digests is not None and manifest.sums_algorithm != devsum.ALGORITHM:
        raise DataIntegrityError(
            f"sample {key!r}: stage {stage} was given {devsum.ALGORITHM} digests for a manifest whose "
            f"sums are {manifest.sums_algorithm}"
        )
    if not manifest.sums:
        store.put_many(items)
        return sum(t.numel() * t.element_size() for _, t in items)
    if manifest.sums_algorithm == devsum.ALGORITHM:
        known = {want_layers[k].key: d for k, d in (layer_digests or {}).items() if k in want_layers}
        by_key = dict(items)
        todo = [f.key for f in manifest.summed(stage) if f.key not in known]
        known.update(zip(todo, devsum.digests8([by_key[k] for k in todo]), strict=True))
        # Known before the put: the sums object goes in the same batch (one store call, not two).
        raw = b"".join(known[f.key] for f in manifest.summed(stage))
        store.put_many(
            [*items, (manifest.sums[stage].key, torch.frombuffer(bytearray(raw), dtype=torch.uint8))]
        )
        return sum(t.numel() * t.element_size() for _, t in items) + len(raw)
    # In manifest order (`summed`): input_ids first on stage 0, then the layers by capture id. The
    # hashing threads read the bytes while the put copies them; the sums object goes in last (a
    # reader waits for every key the manifest names, so it never checks against a missing one).
    by_key = dict(items)
    pending = checksum.digests8_async([by_key[f.key] for f in manifest.summed(stage)])
    store.put_many(items)
    sums = torch.frombuffer(bytearray(b"".join(f.result() for f in pending)), dtype=torch.uint8)
    store.put_many([(manifest.sums[stage].key, sums)])
    # What the stage's segment holds now (its sums included): `manifest.fragments_of_stage`'s bytes.
    return sum(t.numel() * t.element_size() for _, t in items) + sums.numel()


def _check_mask_values(manifest: Manifest, mask: torch.Tensor) -> None:
    # uint8 (as stored): one pass for "above 1"; other integer kinds also look below 0.
    bad = mask.gt(1) if mask.dtype == torch.uint8 else (mask != 0) & (mask != 1)
    if bool(bad.any()):
        raise DataIntegrityError(
            f"sample {manifest.sample_key!r}, object {manifest.loss_mask.key if manifest.loss_mask else '?'!r}: "
            "loss_mask holds values other than 0 and 1"
        )


def publish_loss_mask(store: ObjectStore, manifest: Manifest, loss_mask: torch.Tensor) -> int:
    """Put the sample's loss mask (`[num_tokens]`, 0/1) under `manifest.loss_mask.key`; bytes put."""
    spec = manifest.loss_mask
    if spec is None:
        raise DataIntegrityError(f"sample {manifest.sample_key!r}: the manifest names no loss_mask object")
    mask = loss_mask.detach().to("cpu")
    if mask.dtype != torch.uint8:
        if mask.dtype.is_floating_point:
            raise DataIntegrityError(
                f"sample {manifest.sample_key!r}, object {spec.key!r}: a float loss_mask"
            )
        _check_mask_values(manifest, mask)
        mask = mask.to(torch.uint8)
    _check_tensor(manifest, spec, mask)
    _check_mask_values(manifest, mask)
    mask = mask.contiguous()
    if spec.digest is not None and checksum.tensor_digest(mask) != spec.digest:
        raise DataIntegrityError(
            f"sample {manifest.sample_key!r}, object {spec.key!r}: the mask does not match the manifest's digest"
        )
    store.put_many([(spec.key, mask)])
    return mask.numel()


def _check_sample(sample: Sample, expected_input_ids: torch.Tensor | None) -> None:
    m = sample.manifest
    if sample.loss_mask is not None:
        _check_mask_values(m, sample.loss_mask)
    ids_key = m.input_ids.key
    want_sha = m.extra.get(INPUT_IDS_SHA256)
    if want_sha is not None and input_ids_digest(sample.input_ids) != want_sha:
        raise DataIntegrityError(
            f"sample {m.sample_key!r}, object {ids_key!r}: input_ids do not match the manifest's "
            f"{INPUT_IDS_SHA256} (the object belongs to another prompt or was corrupted)"
        )
    if expected_input_ids is not None:
        exp = expected_input_ids.reshape(-1).to(torch.int64)
        if exp.shape != sample.input_ids.shape or not torch.equal(exp, sample.input_ids):
            raise DataIntegrityError(
                f"sample {m.sample_key!r}, object {ids_key!r}: input_ids differ from the expected ids"
            )
    if m.num_tokens and int(sample.input_ids.min()) < 0:
        raise DataIntegrityError(f"sample {m.sample_key!r}, object {ids_key!r}: negative token ids")


class FetchCancelledError(Exception):
    """A fetch whose reader stopped waiting (`fetch_sample(cancel=...)`); never a data error."""


def fetch_sample(
    store: ObjectStore,
    manifest: Manifest,
    *,
    retry_max_wait_s: float,
    remove: bool = True,
    expected_input_ids: torch.Tensor | None = None,
    pool: BufferPool | None = None,
    poll_interval_s: float = 0.05,
    device: torch.device | None = None,
    cancel: threading.Event | None = None,
) -> Sample:
    """Fetch and check every object of `manifest`'s sample; return it whole or raise.

    `pool` recycles buffers of samples the consumer has `release()`d (a fresh buffer costs page
    faults on every sample). `expected_input_ids`, when given, must equal the fetched ids.
    `device` (a CUDA trainer's): a sample whose sums are `wmix64` is copied there in one copy and
    its stages' sums are checked there (`_check_on_device`); the sample's `device_copy` is that
    checked copy. Without it, or for XXH3 sums, every check runs on the host.
    `cancel`, once set, ends a wait for objects not yet published with `FetchCancelledError` (a reader
    fetching ahead whose consumer stopped: `data.prefetch`).
    """
    manifest.validate()
    sample = Sample.empty_for(manifest, pool)
    try:
        _fill(
            store,
            manifest,
            sample.destinations() + sample.sum_destinations(),
            retry_max_wait_s,
            poll_interval_s,
            cancel,
        )
        on_device = bool(manifest.sums) and manifest.sums_algorithm == devsum.ALGORITHM
        _check_digests(sample, own_checked=getattr(store, "checks_own_digests", False), sums=not on_device)
        if on_device:
            _check_on_device(sample, device)
        _check_sample(sample, expected_input_ids)
    except BaseException:
        sample.release()
        raise
    if remove:
        store.remove([f.key for f in manifest.all_objects])
    return sample


def _check_digests(sample: Sample, own_checked: bool = False, sums: bool = True) -> None:
    """Every object of `sample` against its XXH3 checksum: its own digest, and (`sums`) its
    stage's sums. All of them are computed at once, on the hashing threads. `own_checked`: the
    store's `get_into` already checked each object that carries a digest of its own (offline
    shards). `sums=False`: the sums are WMIX64, checked by `_check_on_device`."""
    m = sample.manifest
    views = dict(sample.destinations())
    own = [] if own_checked else [spec for spec in m.data_objects if spec.digest is not None]
    summed = _summed(m) if sums else []
    futures = checksum.digests8_async([views[spec.key] for spec in own] + [views[s.key] for *_, s in summed])
    try:
        for spec, fut in zip(own, futures[: len(own)], strict=True):
            if checksum.digest8_text(fut.result()) != spec.digest:
                raise DataIntegrityError(
                    f"sample {m.sample_key!r}, object {spec.key!r}: its bytes do not match the "
                    "manifest's checksum"
                )
        _compare_sums(sample, summed, [fut.result() for fut in futures[len(own) :]], "checksum")
        sample.checked.update(
            (spec.key, fut.result())
            for spec, fut in zip([*own, *(s for *_, s in summed)], futures, strict=True)
        )
    finally:
        # The hashing threads read the sample's buffer: it is released only once they are done.
        wait(futures)


def _summed(m: Manifest) -> list[tuple[int, int, FragmentSpec]]:
    """(stage, index in its sums object, object) of every object a stage's sums object covers."""
    return [(stage, i, spec) for stage in range(len(m.sums)) for i, spec in enumerate(m.summed(stage))]


def _compare_sums(
    sample: Sample, summed: Sequence[tuple[int, int, FragmentSpec]], got: Sequence[bytes], what: str
) -> None:
    """Each of `got` against the 8 bytes its stage published; a mismatch names the object."""
    m = sample.manifest
    wants = [raw.numpy().tobytes() for raw in sample.sums]
    for (stage, i, spec), raw in zip(summed, got, strict=True):
        if raw != wants[stage][i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES]:
            raise DataIntegrityError(
                f"sample {m.sample_key!r}, object {spec.key!r}: its bytes do not match the {what} "
                f"stage {stage} published ({m.sums[stage].key!r})"
            )


# One copy stream per (thread, device): a reader's worker threads (`data.prefetch`) copy and check
# their samples side by side, each waiting only for its own stream.
_copy_streams = threading.local()


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    streams: dict[torch.device, torch.cuda.Stream] = getattr(_copy_streams, "by_device", None) or {}
    if device not in streams:
        streams[device] = torch.cuda.Stream(device)
        _copy_streams.by_device = streams
    return streams[device]


def _check_on_device(sample: Sample, device: torch.device | None) -> None:
    """A `wmix64` sample: the objects its stages summed, checked on `device` (CUDA) from one copy
    of the whole buffer there, made and summed on a stream of its own; the host waits for that
    stream alone, never for the trainer's queued steps. The copy becomes `sample.device_copy`,
    marked in use on the caller's stream. Without a CUDA device the sums run on the host (torch;
    slow, see `hpctoolkit.integrity.devsum`). Objects with their own XXH3 digest (the loss mask) are
    `_check_digests`'s."""
    summed = _summed(sample.manifest)
    copy = None
    if device is not None and device.type == "cuda":
        consumer = torch.cuda.current_stream(device)
        with torch.cuda.stream(_copy_stream(device)):
            copy = sample.copy_to(device)
            on_device = dict(copy.destinations())
            got = devsum.digests8([on_device[spec.key] for *_, spec in summed])  # waits for the stream
        copy.used_on(consumer)  # allocated on the copy stream, read on the caller's
    else:
        views = dict(sample.destinations())
        got = devsum.digests8([views[spec.key] for *_, spec in summed])
    _compare_sums(sample, summed, got, f"{devsum.ALGORITHM} checksum")
    sample.device_copy = copy


def _fill(
    store: ObjectStore,
    manifest: Manifest,
    dests: Sequence[tuple[str, torch.Tensor]],
    retry_max_wait_s: float,
    poll_interval_s: float,
    cancel: threading.Event | None = None,
) -> None:
    keys = [k for k, _ in dests]
    tensors = [t for _, t in dests]
    deadline = time.monotonic() + retry_max_wait_s
    delay = poll_interval_s
    while True:
        try:
            store.get_into(keys, tensors)
            break
        except MissingKeysError as err:
            pending: Sequence[str] = err.keys
            last_err: Exception = err
        except TransientStoreError as err:
            pending, last_err = keys, err
        except StoreError as err:
            raise DataIntegrityError(f"sample {manifest.sample_key!r}: {err}") from err
        # Poll cheaply for what is missing instead of moving the whole sample again each time.
        while True:
            now = time.monotonic()
            if now >= deadline:
                if isinstance(last_err, MissingKeysError):
                    raise DataIntegrityError(
                        f"sample {manifest.sample_key!r}: objects {list(pending)} still missing after "
                        f"{retry_max_wait_s:g}s (store.get_retry_max_wait_seconds)"
                    ) from last_err
                cls = (
                    StoreUnavailableError
                    if isinstance(last_err, StoreUnavailableError)
                    else TransientStoreError
                )
                raise cls(
                    f"sample {manifest.sample_key!r}: still failing after {retry_max_wait_s:g}s "
                    f"(store.get_retry_max_wait_seconds): {last_err}"
                ) from last_err
            if cancel is None:
                time.sleep(min(delay, deadline - now))
            elif cancel.wait(min(delay, deadline - now)):
                raise FetchCancelledError(
                    f"sample {manifest.sample_key!r}: its reader stopped waiting for it"
                )
            delay = min(delay * 1.5, 1.0)
            try:
                present = store.exists(list(pending))
            except StoreUnavailableError as err:
                pending, last_err = keys, err
                continue
            pending = [k for k, ok in zip(pending, present, strict=True) if not ok]
            if not pending:
                break


class LossMasks:
    """An engine leader's loss masks, published beside each captured sample.

    `samples` are the `(input_ids, loss_mask)` the engine captures, in capture order. `publish`
    finds a manifest's mask by its `input_ids_sha256` (the first unpublished one of those ids),
    puts it and returns the manifest naming it (`with_loss_mask`). A manifest whose ids match no
    prompt of this engine raises `DataIntegrityError` naming the sample.
    """

    def __init__(self, store: ObjectStore, samples: Sequence[tuple[Sequence[int], Sequence[int]]]):
        from collections import deque

        self.store = store
        self._by_digest: dict[str, deque[torch.Tensor]] = {}
        for ids, mask in samples:
            if len(ids) != len(mask):
                raise DataIntegrityError(f"a prompt of {len(ids)} tokens has a loss mask of {len(mask)}")
            digest = input_ids_digest(torch.tensor(list(ids), dtype=torch.int64))
            self._by_digest.setdefault(digest, deque()).append(torch.tensor(list(mask), dtype=torch.uint8))
        self.published = 0
        self.supervised = 0

    def publish(self, manifest: Manifest) -> Manifest:
        from hpctoolkit.capture.manifest import with_loss_mask

        digest = manifest.extra.get(INPUT_IDS_SHA256)
        queue = self._by_digest.get(str(digest))
        if not queue:
            raise DataIntegrityError(
                f"sample {manifest.sample_key!r}: its input_ids match no prompt of this engine left "
                "to capture; no loss mask to publish"
            )
        mask = queue.popleft()
        m = with_loss_mask(manifest, checksum.tensor_digest(mask))
        publish_loss_mask(self.store, m, mask)
        self.published += 1
        self.supervised += int(mask.sum())
        return m

    def close(self) -> None:
        self.store.close()


def mask_segment_bytes(lengths: Sequence[int]) -> int:
    """A writer segment that holds every mask of `lengths` (each object rounded up to 4 KiB)."""
    return max(32 << 20, 2 * sum(-(-n // 4096) * 4096 for n in lengths))
