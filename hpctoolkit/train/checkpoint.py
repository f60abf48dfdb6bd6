"""Training checkpoints through `torch.distributed.checkpoint`, with rotation.

Layout under `<out_dir>/checkpoints/`:

    step-00000030/            DCP shards of {"model", "optim"} (every rank writes its own)
    step-00000030/rank-0.pt   per-rank: scheduler, torch/CUDA RNG, the sample stream's position
    step-00000030/ledger-rank0.json  per-rank: the prompts it trained on (`rundir.ledger`)
    step-00000030/meta.json   step, world size, family, and every file's size and checksum
                              (`hpctoolkit.integrity.checksum`); written last, marks the checkpoint complete

Every file is written to a temporary name, synced and renamed (DCP syncs its shards; the rest go
through `rundir.atomic`). A checkpoint is written under `step-N.partial` and renamed once every
rank has finished, and `meta.json` is renamed into place last, so a crash mid-save never leaves a
directory that `latest()` would pick. Only `step-<digits>` directories with a `meta.json` count
(`rundir.ledger.complete_checkpoints`); anything else in `checkpoints/` is ignored.

A full disk (or quota) mid-save is a `rundir.atomic.DiskFullError`, one line naming the checkpoint,
about the bytes it needed and those free; the half-written checkpoint is removed (a `.partial`
left by a rank that failed alone goes at the next save) and the previous one stays the newest.

Resuming (`load_newest`) checks the newest complete checkpoint against its `meta.json` first (each
rank a slice of the files), then loads it. An unreadable one (a file truncated, or removed by a
scratch purge: `meta.json` lists every file) is renamed `step-N.unreadable` (kept, never deleted,
and no longer picked) and the previous complete one is loaded instead, in one warning line naming
both; with none readable the resume fails. A live run that resumed from the sample ledger of a
checkpoint cannot fall back (its engines capture only what that checkpoint did not train on) and
fails closed instead. `torch.load` reads with `weights_only=True`: a pickled
object in a checkpoint is refused, never run.

Only the newest `keep_checkpoints` complete ones are kept. All ranks must see the same `out_dir`
(a shared filesystem on a cluster).
"""

from __future__ import annotations

import io
import json
import logging
import pickle
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.integrity import checksum
from hpctoolkit.output.console import speaker
from hpctoolkit.rundir import ledger
from hpctoolkit.rundir.atomic import disk_full, read_json, write_bytes_atomic, write_json_atomic
from hpctoolkit.train.fsdp import DistContext

log = logging.getLogger(__name__)
META = ledger.META
UNREADABLE = ".unreadable"
say = speaker("trainer")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


class Checkpointer:
    def __init__(self, root: Path, keep: int, ctx: DistContext) -> None:
        self.root = Path(root)
        self.keep = keep
        self.ctx = ctx

    def complete(self) -> list[Path]:
        return ledger.complete_checkpoints(self.root)

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def save(
        self,
        step: int,
        model,
        optimizer,
        scheduler,
        *,
        samples_consumed: dict[str, int],
        meta: dict[str, Any],
        prompts: Mapping[int, str | None] | Iterable[int] = (),
    ) -> Path:
        """Collective: every rank calls it at the same step. `samples_consumed` is this rank's
        `SampleStream.position` (`{"epoch", "offset"}`); `load` returns it under the same key.
        `prompts`: the prompts this rank trained on up to `step`, each with its content key (its
        part of the sample ledger)."""
        final = self.root / step_dir_name(step)
        tmp = self.root / (final.name + ".partial")
        try:
            return self._save(step, final, tmp, model, optimizer, scheduler, samples_consumed, meta, prompts)
        except BaseException as err:
            if self.ctx.is_main:
                shutil.rmtree(tmp, ignore_errors=True)  # before the free bytes are counted
                if not (final / META).is_file():
                    shutil.rmtree(final, ignore_errors=True)  # renamed, but its record did not fit
            full = disk_full(err, tmp, _state_bytes(model, optimizer), estimate=True)
            if full is None:
                raise
            raise full.within(f"checkpoint at step {step}") from err

    def _save(
        self,
        step: int,
        final: Path,
        tmp: Path,
        model,
        optimizer,
        scheduler,
        samples_consumed: dict[str, int],
        meta: dict[str, Any],
        prompts: Mapping[int, str | None] | Iterable[int],
    ) -> Path:
        if self.ctx.is_main:
            for stale in self.root.glob("step-*.partial"):  # a failed save's; `tmp` among them
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.ctx.barrier()
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
        extra = {
            "scheduler": scheduler.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "samples_consumed": samples_consumed,
            "step": step,
        }
        # Serialized in memory first: torch's zip writer reports a full disk without its errno.
        buf = io.BytesIO()
        torch.save(extra, buf)
        write_bytes_atomic(tmp / f"rank-{self.ctx.rank}.pt", buf.getvalue())
        ledger.write_part(tmp, self.ctx.rank, step, prompts)
        self.ctx.barrier()
        # Each rank sums a slice of the files (read back from its page cache), rank 0 collects.
        names = sorted(p for p in tmp.rglob("*") if p.is_file() and not _scratch(p.name))
        mine = names[self.ctx.rank :: self.ctx.world_size]
        write_json_atomic(tmp / _sums_name(self.ctx.rank), checksum.files_record(mine, tmp))
        self.ctx.barrier()
        if self.ctx.is_main:
            files: dict[str, Any] = {}
            for r in range(self.ctx.world_size):
                files.update(read_json(tmp / _sums_name(r)) or {})
                (tmp / _sums_name(r)).unlink()
            if len(files) != len(names):
                raise DataIntegrityError(f"checkpoint {tmp}: {len(names) - len(files)} files were not summed")
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            # Last, and atomically: only now does the checkpoint (with its ledger) count.
            record = {"step": step, "world_size": self.ctx.world_size, **meta, "files": files}
            write_json_atomic(final / META, record, indent=2)
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.ctx.barrier()
        return final

    def load_newest(self, model, optimizer, scheduler, *, fallback: bool = True) -> dict[str, Any] | None:
        """`load` the newest complete checkpoint that reads back whole (None when there is none).
        Collective. `fallback=False`: an unreadable newest one fails instead (a live resume)."""
        done = self.complete()
        while done:
            path = done.pop()
            why = self._unreadable(path)
            if why is None:
                try:
                    return self.load(path, model, optimizer, scheduler)
                except (OSError, RuntimeError, ValueError, KeyError, EOFError, pickle.UnpicklingError) as err:
                    if isinstance(err, ConfigError | DataIntegrityError) or self.ctx.world_size > 1:
                        raise
                    why = f"{type(err).__name__}: {err}"
            instead = f"resuming from {done[-1]} instead" if done else "no earlier complete checkpoint"
            line = f"WARNING: checkpoint {path} is unreadable ({why}); {instead}"
            if not fallback:
                raise DataIntegrityError(
                    f"checkpoint {path} is unreadable ({why}); this live attempt's engines capture only "
                    "what it did not train on, so no earlier checkpoint can stand in: move it aside "
                    "and submit again"
                )
            if not done:
                raise DataIntegrityError(line.removeprefix("WARNING: ") + " to resume from")
            if self.ctx.is_main:
                say(line)
                log.warning(line)
                path.rename(path.with_name(path.name + UNREADABLE))
            self.ctx.barrier()
        return None

    def _unreadable(self, path: Path) -> str | None:
        """Why `path` does not match its `meta.json` on some rank (each checks a slice), or None.
        Collective: every rank gets the same answer."""
        why = None
        meta = read_json(path / META)
        if not isinstance(meta, dict) or not isinstance(meta.get("world_size"), int):
            why = f"{META} is not a checkpoint record"
        elif isinstance(meta.get("files"), dict):  # checkpoints before 2026-12-04 carry no sums
            names = sorted(meta["files"])[self.ctx.rank :: self.ctx.world_size]
            try:
                why = checksum.check_files(meta["files"], path, names)
            except (OSError, KeyError, TypeError) as err:
                why = f"{type(err).__name__}: {err}"
        bad = torch.zeros(self.ctx.world_size)
        bad[self.ctx.rank] = 1.0 if why else 0.0
        bad = self.ctx.all_reduce_sum(bad.to(self.ctx.device)).cpu()  # NCCL reduces device tensors
        if why is None and bool(bad.any()):
            ranks = [r for r, b in enumerate(bad.tolist()) if b]
            why = f"rank {ranks[0]} found a file that does not match its checksum"
        return why

    def load(self, path: Path, model, optimizer, scheduler) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and RNG; returns meta plus this rank's counters."""
        meta = json.loads((path / META).read_text())
        meta.pop("files", None)
        if meta["world_size"] != self.ctx.world_size:
            raise ConfigError(
                f"checkpoint {path} was written by {meta['world_size']} ranks, this run has "
                f"{self.ctx.world_size}; the data order would not continue where it stopped "
                "(resume with the same training.world_size, or start a fresh output_dir)"
            )
        msd, osd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": msd, "optim": osd}  # DCP's STATE_DICT_TYPE
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        extra = torch.load(path / f"rank-{self.ctx.rank}.pt", weights_only=True)
        scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])
        if extra.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["cuda_rng"])
        log.info("resumed from %s at step %d", path, meta["step"])
        # A checkpoint from before the ledger has none; a live resume refuses it (`read_ledger`).
        has_part = (path / ledger.part_name(self.ctx.rank)).is_file()
        prompts = ledger.read_part(path, self.ctx.rank) if has_part else {}
        return {**meta, "samples_consumed": extra["samples_consumed"], "prompts": prompts}


def _state_bytes(model, optimizer) -> int:
    """About the bytes a checkpoint of `model` and `optimizer` takes (every rank's share)."""
    tensors = [*model.parameters(), *model.buffers()]
    for state in optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _sums_name(rank: int) -> str:
    return f".sums-rank{rank}.json"


def _scratch(name: str) -> bool:
    """A rank's sums, or a temporary file (`rundir.atomic`): not part of the checkpoint."""
    return name.startswith(".sums-rank") or ".tmp-" in name
