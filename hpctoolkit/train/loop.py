# ruff: noqa: N806  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""One training rank: build, shard, (resume,) train, checkpoint, export. Called by `run.train`."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpctoolkit.errors import ConfigError
from hpctoolkit.train.batch import collate
from hpctoolkit.train.checkpoint import Checkpointer
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.fsdp import DistContext, build_mesh, init_distributed, shard_trainer
from hpctoolkit.train.metrics import StepStats, TensorBoardLog, Window
from hpctoolkit.train.optim import build_optimizer, clip_and_norm
from hpctoolkit.train.source import SamplesSource, SampleStream, make_opener
from hpctoolkit.train.trainers import FamilyTrainer, build_trainer

log = logging.getLogger(__name__)
# Samples read to choose a pruned Eagle3 vocabulary (per rank; counts are summed over ranks).
VOCAB_SCAN_SAMPLES = 256


@dataclass
class TrainJob:
    """Everything a rank needs; picklable, because `world_size > 1` spawns processes."""

    draft_config: str
    target_dir: str
    training: TrainingConfig
    samples_source: SamplesSource
    out_dir: str
    resume: bool = True
    init_method: str = ""
    show_progress: bool = True
    # Stop after this many steps of this invocation (tests interrupt a run to resume it).
    stop_after: int | None = None
    extra_meta: dict[str, Any] = field(default_factory=dict)


def _vocab_counts(job: TrainJob, opener, ctx: DistContext, vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for i, s in enumerate(opener(ctx.rank, ctx.world_size, 0, 0)):
        if i >= VOCAB_SCAN_SAMPLES:
            break
        counts += torch.bincount(s.input_ids.long(), minlength=vocab_size)[:vocab_size].to(torch.float64)
    return ctx.all_reduce_sum(counts.to(ctx.device)).cpu()


def _full_draft_state(trainer: FamilyTrainer) -> dict[str, torch.Tensor]:
    """The draft's full (unsharded) state dict on the CPU; collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(trainer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k.removeprefix("draft."): v for k, v in sd.items() if k.startswith("draft.")}


def forward_backward(trainer: FamilyTrainer, batch, step: int, ctx: DistContext):
    """Forward, normalise by the global denominator, backward. Returns this rank's `LossParts`.

    The denominator is summed over ranks and the local numerator scaled by `world_size`, so after
    FSDP averages gradients the step's gradient is that of `sum(numerators) / sum(denominators)`.
    """
    parts = trainer.run(batch, step)
    den = ctx.all_reduce_sum(parts.denominator.detach().to(torch.float64).reshape(1).clone())
    scale = ctx.world_size / max(float(den), 1e-12)
    (parts.numerator * scale).backward()
    return parts


def run_rank(rank: int, world_size: int, job: TrainJob) -> dict[str, Any] | None:
    """Train on this rank; rank 0 returns the summary, the others None."""
    cfg = job.training
    if cfg.device == "cpu" and world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    ctx = init_distributed(rank, world_size, job.init_method, cfg.device)
    try:
        return _train(ctx, job)
    finally:
        ctx.close()


def _train(ctx: DistContext, job: TrainJob) -> dict[str, Any] | None:
    cfg = job.training
    out = Path(job.out_dir)
    opener = make_opener(job.samples_source, cfg.seed)
    from hpctoolkit.models.registry import load_draft_config
    from hpctoolkit.train.trainers import needs_vocab_counts

    draft_cfg = load_draft_config(job.draft_config)
    counts = None
    if needs_vocab_counts(draft_cfg):
        counts = _vocab_counts(job, opener, ctx, draft_cfg.vocab_size)
    trainer = build_trainer(draft_cfg, job.target_dir, cfg, vocab_counts=counts)
    trainer.to(ctx.device)
    shard_trainer(trainer, build_mesh(ctx, cfg.fsdp_mode), cfg)
    optimizer, scheduler = build_optimizer(trainer, cfg)
    ckpt = Checkpointer(out / "checkpoints", cfg.keep_checkpoints, ctx)

    start_step, position = 0, {"epoch": 0, "offset": 0}
    latest = ckpt.latest() if job.resume else None
    if latest is not None:
        meta = ckpt.load(latest, trainer, optimizer, scheduler)
        start_step = int(meta["step"])
        position = meta["samples_consumed"]
    stream = SampleStream(opener, ctx.rank, ctx.world_size, **position)
    P = trainer.num_positions
    tb = TensorBoardLog(out / "tensorboard", enabled=ctx.is_main)
    window = Window(max(1, min(20, cfg.steps // 5)))
    bar = None
    if ctx.is_main and job.show_progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, desc=f"train {trainer.family}", dynamic_ncols=True)

    order_dir = out / "data_order"
    order_dir.mkdir(parents=True, exist_ok=True)
    # Which samples each step read, per rank: what resume is checked against.
    order_log = (order_dir / f"rank{ctx.rank}.jsonl").open("a" if start_step else "w")
    step = start_step
    last_stats: StepStats | None = None
    stop_reason = ""
    tokens_total = 0.0
    t_start = time.monotonic()
    steps_this_run = 0
    train_dtype = torch.float32
    while step < cfg.steps:
        if job.stop_after is not None and steps_this_run >= job.stop_after:
            stop_reason = "stop_after"
            break
        samples = stream.next_batch(cfg.batch_size)
        have = torch.tensor([0.0 if samples is None else 1.0], device=ctx.device)
        if ctx.world_size > 1:
            torch.distributed.all_reduce(have, op=torch.distributed.ReduceOp.MIN)
        if float(have) == 0.0:
            stop_reason = f"samples source exhausted at step {step}"
            break
        t0 = time.monotonic()
        batch = collate(samples, max_seq_len=cfg.max_seq_len, min_loss_tokens=cfg.min_loss_tokens)
        batch = batch.to(ctx.device, train_dtype)
        order_log.write(json.dumps({"step": step + 1, "keys": batch.keys}) + "\n")
        order_log.flush()
        parts = forward_backward(trainer, batch, step, ctx)
        grad_norm = clip_and_norm(trainer, cfg.grad_clip)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        vec = torch.cat(
            [
                parts.stats_vector(),
                torch.tensor([float(batch.num_tokens)], dtype=torch.float64, device=ctx.device),
            ]
        )
        vec = ctx.all_reduce_sum(vec).cpu()
        dt = time.monotonic() - t0
        step += 1
        steps_this_run += 1
        tokens = float(vec[-1])
        tokens_total += tokens
        stats = StepStats(P, tuple(parts.extras), vec[:-1])
        if not math.isfinite(stats.loss):
            raise FloatingPointError(
                f"loss is {stats.loss} at step {step}; stopping instead of training on it"
            )
        window.add(stats)
        last_stats = stats
        if ctx.is_main:
            scalars = {
                "grad_norm": grad_norm,
                "lr": lr,
                "tokens_per_s": tokens / max(dt, 1e-9),
                "tokens_per_s_per_rank": tokens / max(dt, 1e-9) / ctx.world_size,
            }
            if step % cfg.log_every == 0 or step == cfg.steps:
                tb.log(step, stats, scalars)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    loss=f"{stats.loss:.3f}",
                    acc0=f"{stats.pos_accuracy()[0]:.2f}",
                    tau=f"{stats.acceptance_length_incl_bonus():.2f}",
                    gn=f"{grad_norm:.2f}",
                    tok_s=f"{scalars['tokens_per_s']:.0f}",
                )
        if step % cfg.checkpoint_every == 0 or step == cfg.steps:
            ckpt.save(
                step,
                trainer,
                optimizer,
                scheduler,
                samples_consumed=stream.position,
                meta={"family": trainer.family},
            )
    if bar is not None:
        bar.close()
    order_log.close()
    tb.close()
    wall = time.monotonic() - t_start

    finished = step >= cfg.steps
    if not finished and stop_reason != "stop_after" and step > start_step:
        # Data ran out early: keep what was trained.
        ckpt.save(
            step,
            trainer,
            optimizer,
            scheduler,
            samples_consumed=stream.position,
            meta={"family": trainer.family},
        )

    export_dir, export_error = None, None
    if cfg.export and stop_reason != "stop_after":
        state = _full_draft_state(trainer)
        if ctx.is_main:
            cpu_draft = _save_training_format(trainer, state, out)
            try:
                export_dir = _export(cpu_draft, out)
            except ConfigError as err:
                # The trained draft is kept (out/draft, checkpoints); only vLLM cannot serve it.
                export_error = str(err)
                log.error("export to %s refused: %s", out / "export", err)
    ctx.barrier()
    if not ctx.is_main:
        return None
    total = window.total()
    summary: dict[str, Any] = {
        "family": trainer.family,
        "steps_trained": step,
        "steps_this_run": steps_this_run,
        "resumed_from_step": start_step,
        "final_loss": last_stats.loss if last_stats else None,
        "acceptance_length": total.acceptance_length_incl_bonus() if total else None,
        "acceptance_convention": "acceptance_length includes the +1 bonus token (EAGLE / vLLM convention)",
        "train_tokens_per_s": tokens_total / max(wall, 1e-9),
        "train_tokens_per_s_per_rank": tokens_total / max(wall, 1e-9) / ctx.world_size,
        "world_size": ctx.world_size,
        "stop_reason": stop_reason or "completed",
        "samples_position": stream.position,
        "checkpoint_dir": str(ckpt.latest()) if ckpt.latest() else None,
        "draft_dir": str(out / "draft") if (out / "draft").is_dir() else None,
        "tensorboard_dir": str(out / "tensorboard"),
    }
    if total is not None:
        summary["train_window_steps"] = total.steps
        summary["train_metrics"] = total.summary()
        from hpctoolkit.train.plot import plot_acceptance

        summary["acceptance_plot"] = str(
            plot_acceptance(
                out / "acceptance_per_position.png",
                acceptance_rate_per_pos=total.acceptance_rate_per_pos(),
                accuracy_per_pos=total.pos_accuracy(),
                title=(
                    f"{trainer.family}: acceptance length {total.acceptance_length_incl_bonus():.2f} "
                    f"(incl. bonus), last {total.steps} steps"
                ),
            )
        )
    if export_dir is not None:
        summary["export_dir"] = str(export_dir)
    if export_error is not None:
        summary["export_error"] = export_error
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def _save_training_format(
    trainer: FamilyTrainer, state: dict[str, torch.Tensor], out: Path
) -> torch.nn.Module:
    """`out/draft`: the full draft under our module names (what `python -m hpctoolkit.export` reads)."""
    from hpctoolkit.models import build_draft_model, save_draft

    cpu_model = build_draft_model(trainer.draft.config)
    missing, unexpected = cpu_model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"gathered draft state does not match the model: missing {missing}, unexpected {unexpected}"
        )
    save_draft(cpu_model, out / "draft")
    return cpu_model


def _export(cpu_draft: torch.nn.Module, out: Path) -> Path:
    """`out/export`: the vLLM serving checkpoint, through the models' `export_draft`."""
    from hpctoolkit.export import export_draft

    return export_draft(cpu_draft, cpu_draft.config, out / "export")
