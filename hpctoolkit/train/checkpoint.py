"""Training checkpoints through `torch.distributed.checkpoint`, with rotation.

Layout under `<out_dir>/checkpoints/`:

    step-00000030/            DCP shards of {"model", "optim"} (every rank writes its own)
    step-00000030/rank-0.pt   per-rank: scheduler, torch/CUDA RNG, the sample stream's position
    step-00000030/ledger-rank0.json  per-rank: the prompts it trained on (`rundir.ledger`)
    step-00000030/meta.json   step, world size, family; written last, marks the checkpoint complete

A checkpoint is written under `step-N.partial` and renamed once every rank has finished, so a
crash mid-save never leaves a directory that `latest()` would pick. Only the newest
`keep_checkpoints` complete ones are kept. All ranks must see the same `out_dir` (a shared
filesystem on a cluster).
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from hpctoolkit.errors import ConfigError
from hpctoolkit.rundir import ledger
from hpctoolkit.rundir.atomic import write_json_atomic
from hpctoolkit.train.fsdp import DistContext

log = logging.getLogger(__name__)
META = "meta.json"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


class Checkpointer:
    def __init__(self, root: Path, keep: int, ctx: DistContext) -> None:
        self.root = Path(root)
        self.keep = keep
        self.ctx = ctx

    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        dirs = [p for p in self.root.glob("step-*") if p.is_dir() and (p / META).is_file()]
        return sorted(dirs, key=lambda p: int(p.name.split("-")[1]))

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
        prompts: Iterable[int] = (),
    ) -> Path:
        """Collective: every rank calls it at the same step. `samples_consumed` is this rank's
        `SampleStream.position` (`{"epoch", "offset"}`); `load` returns it under the same key.
        `prompts`: the prompts this rank trained on up to `step` (its part of the sample ledger)."""
        final = self.root / step_dir_name(step)
        tmp = self.root / (final.name + ".partial")
        if self.ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.ctx.barrier()
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp))
        torch.save(
            {
                "scheduler": scheduler.state_dict(),
                "rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
                "samples_consumed": samples_consumed,
                "step": step,
            },
            tmp / f"rank-{self.ctx.rank}.pt",
        )
        ledger.write_part(tmp, self.ctx.rank, step, prompts)
        self.ctx.barrier()
        if self.ctx.is_main:
            shutil.rmtree(final, ignore_errors=True)
            tmp.rename(final)
            # Last, and atomically: only now does the checkpoint (with its ledger) count.
            write_json_atomic(
                final / META, {"step": step, "world_size": self.ctx.world_size, **meta}, indent=2
            )
            for old in self.complete()[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        self.ctx.barrier()
        return final

    def load(self, path: Path, model, optimizer, scheduler) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and RNG; returns meta plus this rank's counters."""
        meta = json.loads((path / META).read_text())
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
        extra = torch.load(path / f"rank-{self.ctx.rank}.pt", weights_only=False)
        scheduler.load_state_dict(extra["scheduler"])
        torch.set_rng_state(extra["rng"])
        if extra.get("cuda_rng") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(extra["cuda_rng"])
        log.info("resumed from %s at step %d", path, meta["step"])
        # A checkpoint from before the ledger has none; a live resume refuses it (`read_ledger`).
        has_part = (path / ledger.part_name(self.ctx.rank)).is_file()
        prompts = ledger.read_part(path, self.ctx.rank) if has_part else []
        return {**meta, "samples_consumed": extra["samples_consumed"], "prompts": prompts}
