"""`train(cfg, samples_source, out_dir)`: the trainer's entry point (`train_on` a resolved target).

- `world_size == 1`: runs in this process (a one-rank gloo/NCCL group, so FSDP and the
  distributed checkpoint take the same path as on a cluster).
- `world_size > 1` on the CPU: spawns `world_size` processes joined through a file rendezvous.
- Under an external launcher (`srun` / `torchrun` set `RANK` and `WORLD_SIZE`): this process is
  one rank and joins `env://`; it returns the summary on rank 0 and None elsewhere.

Outputs in `out_dir`: `checkpoints/step-*` (rotated), `tensorboard/`, `acceptance_per_position.png`,
`draft/` (our module names), `export/` (what vLLM serves), and `train_summary.json`.
See `train/source.py` for what `samples_source` may be.
"""

from __future__ import annotations

import json
import os
import pickle
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from hpctoolkit.errors import ConfigError
from hpctoolkit.targets.resolve import resolve_target
from hpctoolkit.train.loop import TrainJob, run_rank
from hpctoolkit.train.source import SamplesSource


def _spawn_entry(rank: int, world_size: int, job: TrainJob) -> None:
    run_rank(rank, world_size, job)


def launch(job: TrainJob, world_size: int) -> dict[str, Any] | None:
    """Run `job` on `world_size` ranks as described in the module docstring."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        if int(os.environ["WORLD_SIZE"]) != world_size:
            raise ConfigError(
                f"training.world_size={world_size} but the launcher started {os.environ['WORLD_SIZE']} ranks"
            )
        job.init_method = "env://"
        return run_rank(int(os.environ["RANK"]), world_size, job)
    rendezvous = Path(tempfile.gettempdir()) / f"hpctoolkit-rdzv-{uuid.uuid4().hex}"
    job.init_method = f"file://{rendezvous}"
    try:
        if world_size == 1:
            return run_rank(0, 1, job)
        try:
            pickle.dumps(job.samples_source)
        except Exception as err:
            raise ConfigError(
                "samples_source must be picklable when training.world_size > 1 (use a module-level "
                f"function or functools.partial, not a lambda): {err}"
            ) from err
        mp.start_processes(
            _spawn_entry, args=(world_size, job), nprocs=world_size, join=True, start_method="spawn"
        )
        return json.loads(job.files.summary.read_text())
    finally:
        rendezvous.unlink(missing_ok=True)


def train(
    cfg,
    samples_source: SamplesSource,
    out_dir: str | os.PathLike,
    *,
    resume: bool = True,
    progress_file: str | os.PathLike = "",
) -> dict[str, Any]:
    """`train_on` the target `cfg.paths.target_model` names, resolved here (built or converted on
    first use; the trainer role's job builder resolves it before it hands over)."""
    cfg.training.validate()  # before a target is built or converted
    target_dir = resolve_target(str(cfg.paths.target_model))
    return train_on(cfg, target_dir, samples_source, out_dir, resume=resume, progress_file=progress_file)


def train_on(
    cfg,
    target_dir: str | os.PathLike,
    samples_source: SamplesSource,
    out_dir: str | os.PathLike,
    *,
    resume: bool = True,
    progress_file: str | os.PathLike = "",
) -> dict[str, Any]:
    """Train the draft of `cfg` (a `RecipeConfig`) for `cfg.training.steps` on the target checkpoint
    in `target_dir` (resolved: `targets.resolve.resolve_target`) and export it.

    Resumes from the newest complete checkpoint in `out_dir/checkpoints` when `resume`. Returns
    the summary (`steps_trained`, `final_loss`, `acceptance_length` incl. the bonus token,
    per-position metrics under `train_metrics`, `export_dir`, ...), also written to
    `out_dir/train_summary.json`. Rank 0 reports its progress (`train.reporter`), also to
    `progress_file` when given (a run directory's `progress/trainer.json`).
    """
    cfg.training.validate()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    job = TrainJob(
        draft_config=str(cfg.draft.config),
        target_dir=str(target_dir),
        training=cfg.training,
        samples_source=samples_source,
        out_dir=str(out),
        resume=resume,
        progress_file=str(progress_file or ""),
        draft_vocab=str(getattr(getattr(cfg, "data", None), "draft_vocab", "") or ""),
    )
    summary = launch(job, cfg.training.world_size)
    return summary or {}
