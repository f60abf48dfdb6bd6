"""Where a rank's samples come from, and the resumable stream the training loop pulls batches from.

`samples_source` (the second argument of `run.train`) is one of:

- **a path** (`str` / `os.PathLike`) to offline shards written by `hpctoolkit.data.offline.ShardWriter`.
  Rank `r` of `w` takes the samples at positions `i % w == r`. Epoch 0 keeps the stored order;
  later epochs use a permutation seeded by `(training.seed, epoch)`, the same on every rank.
- **a factory** `factory(rank, world_size, epoch, skip) -> Iterable[Sample]`, called once per
  epoch on every rank. It must yield this rank's share only, start after its first `skip`
  samples, and give the same order for the same arguments. The live Mooncake path is such a
  factory: `LiveSource` (below) around `HiddenStateDataset(manifests, store, rank=rank,
  world_size=world_size, skip=skip)`; a live source that is read once returns an empty iterable
  for `epoch >= 1`, which ends training cleanly on every rank at the same step. A pruned Eagle3
  vocabulary is chosen from token counts of epoch 0 read once more before training, so a
  factory used with one must tolerate that second read (offline shards do). With `world_size > 1` the
  factory is sent to spawned processes, so it must be picklable (a module-level function or a
  `functools.partial` of one, not a lambda).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpctoolkit.capture.queue import follow_queues
from hpctoolkit.data.dataset import HiddenStateDataset
from hpctoolkit.data.offline import ShardReader, keep_first
from hpctoolkit.data.prefetch import read_ahead
from hpctoolkit.data.spool import SpoolWriter, ThrottledRecord
from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.rundir.layout import SpoolDir

SampleFactory = Callable[[int, int, int, int], Iterable[Any]]
SamplesSource = str | os.PathLike | SampleFactory


def _open_shards(path: Path, rank: int, world_size: int, epoch: int, skip: int, seed: int) -> Iterator[Any]:
    reader = ShardReader(path)
    n = len(reader)
    if n < world_size:
        raise ConfigError(
            f"offline shards {path} hold {n} samples, fewer than training.world_size={world_size}"
        )
    mine = epoch_order(n, seed, epoch)[rank::world_size]
    yield from _read_shards(reader, mine[skip:], workers=2, depth=8, name=f"shards-rank{rank}")


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order `n` stored samples are read in at `epoch`: as stored in the first pass (epoch 0),
    then a permutation drawn from the training seed and the epoch, so that no two epochs train on
    the same batches in the same order. The same on every attempt, so a resume's `skip` lands on
    the sample it stopped at."""
    if epoch == 0:
        return list(range(n))
    g = torch.Generator().manual_seed(seed * 7919 + epoch)
    return torch.randperm(n, generator=g).tolist()


def _read_shards(
    reader: Any, indices: Iterable[int], *, workers: int, depth: int, name: str
) -> Iterator[Any]:
    """Samples `indices` of an offline `ShardReader`, read ahead (`data.prefetch`); the reader's
    files are closed when the iteration ends, however it ends."""
    try:
        yield from read_ahead(indices, reader.__getitem__, workers=workers, depth=depth, name=name)
    finally:
        reader.close()


def make_opener(source: SamplesSource, seed: int) -> Callable[[int, int, int, int], Iterable[Any]]:
    """Normalise `samples_source` to `open(rank, world_size, epoch, skip)`."""
    if isinstance(source, str | os.PathLike):
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"samples source {path} does not exist (expected offline shards)")
        return lambda r, w, e, s: _open_shards(path, r, w, e, s, seed)
    if callable(source):
        return source
    raise ConfigError(
        f"samples_source must be a shard directory or a factory(rank, world_size, epoch, skip), "
        f"got {type(source).__name__}"
    )


class SampleStream:
    """This rank's samples across epochs; `position` is what a checkpoint stores to resume."""

    def __init__(
        self,
        opener: Callable[[int, int, int, int], Iterable[Any]],
        rank: int,
        world_size: int,
        *,
        epoch: int = 0,
        offset: int = 0,
    ) -> None:
        self.opener = opener
        self.rank = rank
        self.world_size = world_size
        self.epoch = epoch
        self.offset = offset
        self._it: Iterator[Any] | None = None
        self.exhausted = False

    @property
    def position(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    def rewind(self, position: dict[str, int]) -> None:
        """Back to `position` (a batch read but never trained on: a preemption dropped it). The
        source's iterator is closed here, so what it must finish (a spool) finishes, or fails, now."""
        self.epoch, self.offset = int(position["epoch"]), int(position["offset"])
        self.close()
        self.exhausted = False

    def close(self) -> None:
        it, self._it = self._it, None
        close = getattr(it, "close", None)
        if close is not None:
            close()

    def sync(self) -> None:
        """What a checkpoint waits for: the source's record of what it handed out is durable
        (`LiveSource.sync`: the replay spool); nothing for a source without one."""
        sync = getattr(self.opener, "sync", None)
        if sync is not None:
            sync()

    def _next(self) -> Any | None:
        fresh_epochs = 0
        while True:
            if self._it is None:
                self._it = iter(self.opener(self.rank, self.world_size, self.epoch, self.offset))
            try:
                item = next(self._it)
            except StopIteration:
                if self.offset == 0:
                    fresh_epochs += 1
                    if fresh_epochs > 1 or self.epoch > 0:
                        # An epoch that yields nothing from its start: the source is spent.
                        self.exhausted = True
                        return None
                self.epoch += 1
                self.offset = 0
                self._it = None
                continue
            self.offset += 1
            return item

    def next_batch(self, n: int) -> list[Any] | None:
        """`n` samples, or None when the source ran dry (the partial batch is not trained on)."""
        out = []
        for _ in range(n):
            item = self._next()
            if item is None:
                return None
            out.append(item)
        return out


def follow_jsonl(path: Path, expected: int, timeout_s: float, poll_s: float = 0.05) -> Iterator[str]:
    """Yield the lines of a JSONL file as a writer appends them, until `expected` lines were seen."""
    seen = 0
    deadline = time.monotonic() + timeout_s
    while seen < expected:
        lines = path.read_text().splitlines() if path.exists() else []
        complete = [x for x in lines[seen:] if x.strip()]
        for line in complete:
            seen += 1
            yield line
            if seen >= expected:
                return
        if time.monotonic() > deadline:
            raise DataIntegrityError(
                f"{path}: {seen} of {expected} manifests appeared within {timeout_s:.0f}s"
            )
        time.sleep(poll_s)


@dataclass
class LiveSource:
    """The live path: manifests appended to a JSONL file by the capture, samples from the store.

    `store_factory()` opens this rank's store client (e.g. `functools.partial(MooncakeStore,
    address, store_cfg, role="reader")`; picklable, so spawned ranks can open their own). Each
    rank wraps `HiddenStateDataset(manifests, store, rank=rank, world_size=world_size,
    skip=skip)`, so it fetches (and removes) only its own share. The store hands each sample out
    once: the first epoch reads the store, later ones only replay a spool.

    `follow`, when set, replaces following `manifests_path`: a picklable callable returning the
    manifests in one order every rank agrees on (a Slurm run passes `ManifestQueues`, all engines'
    queues). `spool_dir` (its layout: `rundir.layout.SpoolDir`), when set, holds `read-rank<r>.json`,
    this rank's read record of the first pass: `{"samples", "bytes", "complete"}`, plus, with
    `engine_prefixes` (engine i's sample key prefix at i), `"engines": [{"samples", "stage_bytes":
    [per PP stage]}, ...]`, which an engine leader's backpressure reads (`read_stage_bytes`). It is
    rewritten after every sample.

    `epochs` (`training.epochs`): 1 reads the store once and spools nothing, so training ends
    when the first pass does; E > 1 also keeps this rank's samples as offline shards under
    `spool_dir/rank<r>` and replays them in epochs 1..E-1; 0 replays every later epoch the stream
    asks for. `resumed`: this attempt continues a checkpoint of an earlier one, and the engines
    capture only the prompts its ledger does not hold (`rundir.ledger`), so the first pass's `skip`
    counts samples of the earlier attempt's queue and is not applied to this one's.
    `spool_max_bytes` bounds the spool of all ranks together (each rank keeps at most
    its `1/world_size`); a sample that would pass it raises, never silently goes unspooled.

    The input path keeps the trainer's GPU fed (measured in `benchmarks/trainer_input.py`):
    - the store is read `read_ahead` samples ahead of the trainer on `fetch_workers` threads
      (`data.prefetch`), in the manifests' order, each sample checked (and, for a CUDA trainer,
      copied and checked on its GPU on a side stream) before it is handed out;
    - the spool is written on a thread of its own (`data.spool.SpoolWriter`), in shards of
      `spool_shard_bytes` with one index line each; `sync()` (called before every checkpoint) makes
      every sample handed out so far durable, so a resume cuts the spool to exactly the samples
      its checkpoint trained on;
    - the read record is rewritten at most once a second (`data.spool.ThrottledRecord`);
    - the replay reads ahead the same way, each epoch in an order of its own (`epoch_order`).
    Host memory beyond the batch being trained: up to `read_ahead` fetched samples, up to
    `spool_queue` samples waiting for the spool's thread, and up to `spool_shard_bytes` (plus one
    sample) of the shard being filled; with the defaults and SmolLM2's longest samples (about
    6 MiB) about 0.4 GiB.
    """

    manifests_path: str
    expected: int
    store_factory: Callable[[], Any]
    retry_max_wait_s: float = 60.0
    follow_timeout_s: float = 1800.0
    follow: Callable[[], Iterable[Any]] | None = None
    spool_dir: str | None = None
    epochs: int = 0
    spool_max_bytes: int | None = None
    engine_prefixes: tuple[str, ...] = ()
    resumed: bool = False
    # "cuda": the rank's samples are checked on its current CUDA device and collated from there
    # (`fetch_sample(device=...)`); None: on the host.
    device: str | None = None
    read_ahead: int = 8
    fetch_workers: int = 4
    # The training seed: each replayed epoch reads the spool in its own order (`epoch_order`).
    seed: int = 0
    spool_shard_bytes: int = 256 << 20
    spool_queue: int = 16
    # This process's spool writer while a first pass runs (never pickled: each rank opens its own).
    _writer: Any = field(default=None, init=False, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_writer"] = None
        return state

    def sync(self) -> None:
        """Make every sample handed out so far durable in the spool (a checkpoint's barrier)."""
        if self._writer is not None:
            self._writer.sync()

    @property
    def spools(self) -> bool:
        return self.spool_dir is not None and self.epochs != 1

    def __call__(self, rank: int, world_size: int, epoch: int, skip: int) -> Iterator[Any]:
        if epoch > 0:
            if self.spools and (self.epochs == 0 or epoch < self.epochs):
                yield from self._replay(rank, epoch, skip)
            return
        # A resumed first pass: the store holds only what the checkpoint did not train on (the
        # engines capture those prompts again); the spool keeps the `skip` samples it did.
        keep = 0
        if self.resumed:
            keep, skip = (skip if self.spools else 0), 0
        elif self.spool_dir is not None and skip:
            raise ConfigError(
                f"a live source cannot resume rank {rank} after {skip} samples of its first pass: "
                "the store handed them out already"
            )
        store = self.store_factory()
        try:
            if self.follow is not None:
                manifests = self.follow()
            else:
                manifests = follow_jsonl(Path(self.manifests_path), self.expected, self.follow_timeout_s)
            samples = HiddenStateDataset(
                manifests,
                store,
                retry_max_wait_s=self.retry_max_wait_s,
                rank=rank,
                world_size=world_size,
                skip=skip,
                device=torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else None,
                read_ahead=self.read_ahead,
                workers=self.fetch_workers,
            )
            if self.spool_dir is None:
                yield from samples
            else:
                yield from self._read(samples, rank, world_size, keep)
        finally:
            close = getattr(store, "close", None)
            if close is not None:
                close()

    @property
    def spool(self) -> SpoolDir:
        return SpoolDir(Path(self.spool_dir or "."))

    def read_record(self, rank: int) -> Path:
        return self.spool.read_record(rank)

    def _read(self, samples: Iterable[Any], rank: int, world_size: int, keep: int = 0) -> Iterator[Any]:
        """Hand out `samples`, each first put to this rank's replay spool (when it spools) and
        counted in its read record. `keep`: a resumed first pass continues the spool after the
        earlier attempt's first `keep` samples (those its checkpoint trained on); else it starts anew."""
        shard_dir = self.spool.shards(rank)
        n = nbytes = 0
        if keep and self.spools:
            n, nbytes = keep_first(shard_dir, keep)
        else:
            shutil.rmtree(shard_dir, ignore_errors=True)  # an earlier run's; this pass starts fresh
        self.spool.root.mkdir(parents=True, exist_ok=True)
        bound = None if self.spool_max_bytes is None else self.spool_max_bytes // world_size
        engines: list[dict[str, Any]] = [{"samples": 0, "stage_bytes": []} for _ in self.engine_prefixes]
        complete = False

        def render() -> dict[str, Any]:
            rec: dict[str, Any] = {"samples": n, "bytes": nbytes, "complete": complete}
            if engines:
                # The prefixes tell this attempt's record from an earlier one's (`rundir.ledger`).
                rec["engines"] = [{**e, "stage_bytes": list(e["stage_bytes"])} for e in engines]
                rec["prefixes"] = list(self.engine_prefixes)
            return rec

        record = ThrottledRecord(self.read_record(rank), render)
        writer = (
            SpoolWriter(shard_dir, max_shard_bytes=self.spool_shard_bytes, max_queued=self.spool_queue)
            if self.spools
            else None
        )
        self._writer = writer
        try:
            for sample in samples:
                m = sample.manifest
                if writer is not None:
                    if bound is not None and nbytes + m.nbytes > bound:
                        raise DataIntegrityError(
                            f"rank {rank}'s spool would pass its {bound} bytes of training.spool_max_size "
                            f"({self.spool_max_bytes} over {world_size} rank(s)) at sample {n + 1}; raise it"
                        )
                    writer.put(sample)
                with record.lock:
                    n += 1
                    nbytes += m.nbytes
                    _count_engine(engines, self.engine_prefixes, m)
                record.touch()
                yield sample
            if writer is not None:
                writer.close()  # every sample durable before the record says complete
            complete = True
        finally:
            self._writer = None
            try:
                # Stopped early (a preemption, an error): what was handed out is still made
                # durable; a resume cuts the spool to what its checkpoint trained on. A spool
                # failure here is raised (a checkpoint must not follow it), unless a reading
                # error is already on its way out.
                if writer is not None and not complete:
                    if isinstance(sys.exc_info()[1], Exception):
                        with contextlib.suppress(Exception):
                            writer.close()
                    else:
                        writer.close()
            finally:
                record.close()

    def _replay(self, rank: int, epoch: int, skip: int) -> Iterator[Any]:
        record = self.read_record(rank)
        if not record.exists() or not json.loads(record.read_text()).get("complete"):
            return  # the first pass did not finish: nothing complete to replay
        reader = ShardReader(self.spool.shards(rank))
        yield from _read_shards(
            reader,
            # Until 2026-12-08 every epoch replayed the spool as written: the same batches, in
            # the same order, epoch after epoch (offline shards were already shuffled).
            epoch_order(len(reader), self.seed, epoch)[skip:],
            workers=self.fetch_workers,
            depth=self.read_ahead,
            name=f"replay-rank{rank}",
        )


def _count_engine(engines: list[dict[str, Any]], prefixes: tuple[str, ...], manifest: Any) -> None:
    for i, prefix in enumerate(prefixes):
        if manifest.sample_key.startswith(prefix + "-"):
            e = engines[i]
            e["samples"] += 1
            stage_bytes = e["stage_bytes"]
            stage_bytes.extend([0] * (manifest.pp_size - len(stage_bytes)))
            for s in range(manifest.pp_size):
                stage_bytes[s] += sum(f.nbytes for f in manifest.fragments_of_stage(s))
            return


def read_stage_bytes(
    spool_dir: str | os.PathLike, world_size: int, engine: int, pp_size: int, prefix: str | None = None
) -> list[int]:
    """Bytes of engine `engine`'s samples that the trainer ranks have read, per PP stage, summed
    over their read records (`LiveSource`); a rank without a record yet has read nothing, and so
    has one whose record names another key prefix for the engine (an earlier attempt's)."""
    total = [0] * pp_size
    for r in range(world_size):
        try:
            rec = json.loads(SpoolDir(Path(spool_dir)).read_record(r).read_text())
        except (OSError, ValueError):
            continue
        prefixes = rec.get("prefixes")
        if prefix is not None and prefixes is not None and prefixes[engine : engine + 1] != [prefix]:
            continue
        engines = rec.get("engines") or []
        if engine < len(engines):
            for s, b in enumerate(engines[engine].get("stage_bytes", [])[:pp_size]):
                total[s] += int(b)
    return total


@dataclass
class ManifestQueues:
    """Picklable `LiveSource.follow` over every engine's manifest queue (`capture.queue`)."""

    output_dir: str
    run_prefixes: tuple[str, ...]
    expected: tuple[int, ...] | None = None
    stall_timeout_s: float = 1800.0

    def __call__(self) -> Iterator[str]:
        return follow_queues(
            self.output_dir, self.run_prefixes, expected=self.expected, stall_timeout_s=self.stall_timeout_s
        )
