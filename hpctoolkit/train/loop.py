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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from hpctoolkit import envs
from hpctoolkit.errors import ConfigError
from hpctoolkit.models.checkpoint import save_draft
from hpctoolkit.models.common.draft import DraftModel
from hpctoolkit.models.common.trainer import FamilyTrainer
from hpctoolkit.models.common.vocab import supervised_token_counts
from hpctoolkit.models.export import export_draft
from hpctoolkit.models.registry import build_draft_model, load_draft_config
from hpctoolkit.output.figures import figure
from hpctoolkit.rundir.atomic import read_json, read_json_object, write_json_atomic, write_text_atomic
from hpctoolkit.rundir.layout import TrainDir
from hpctoolkit.rundir.ledger import CONTENT_KEY, PROMPT_KEY, restart_count
from hpctoolkit.rundir.summary import carry_forward
from hpctoolkit.train import preempt
from hpctoolkit.train.batch import collate, length_step
from hpctoolkit.train.build import build_trainer, needs_vocab_counts
from hpctoolkit.train.checkpoint import Checkpointer
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.fsdp import DistContext, build_mesh, compile_enabled, init_distributed, shard_trainer
from hpctoolkit.train.gpu_busy import GpuBusy
from hpctoolkit.train.metrics import StepStats, TensorBoardLog, Window, trainer_figures
from hpctoolkit.train.optim import build_optimizer
from hpctoolkit.train.plot import plot_acceptance
from hpctoolkit.train.reporter import TrainProgress
from hpctoolkit.train.source import SamplesSource, SampleStream, make_opener
from hpctoolkit.train.step import DeviceFeeder, LaunchedStep, launch

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
    # Rank 0's progress record (`rundir.progress`): "" writes none (the lines are printed anyway).
    progress_file: str = ""
    # Stop after this many steps of this invocation (tests interrupt a run to resume it).
    stop_after: int | None = None
    extra_meta: dict[str, Any] = field(default_factory=dict)
    # A pruned Eagle3 vocabulary saved by an earlier run (`draft_vocab.json`); "" counts this data's.
    draft_vocab: str = ""

    @property
    def files(self) -> TrainDir:
        """Where each output of the run lives in `out_dir` (`rundir.layout.TrainDir`)."""
        return TrainDir(Path(self.out_dir))


DRAFT_VOCAB_FILE = TrainDir(Path()).draft_vocab.name


def _vocab_counts(job: TrainJob, opener, ctx: DistContext, vocab_size: int) -> torch.Tensor:
    """Counts of the supervised tokens (loss mask 1) of each rank's first samples, summed."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for i, s in enumerate(opener(ctx.rank, ctx.world_size, 0, 0)):
        if i >= VOCAB_SCAN_SAMPLES:
            break
        counts += supervised_token_counts(s, vocab_size)
    return ctx.all_reduce_sum(counts.to(ctx.device)).cpu()


def _saved_vocab_counts(path: str, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """Counts that choose exactly the target ids of a saved vocabulary."""
    p = Path(path)
    saved = read_json_object(p, "data.draft_vocab")
    ids = saved.get("target_ids")
    if saved.get("vocab_size") != vocab_size or not isinstance(ids, list) or len(ids) != draft_vocab_size:
        raise ConfigError(
            f"data.draft_vocab: {p} holds {len(ids) if isinstance(ids, list) else 'no'} ids of a "
            f"{saved.get('vocab_size')}-token vocabulary; this draft needs {draft_vocab_size} of {vocab_size}"
        )
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    counts[torch.tensor(ids, dtype=torch.long)] = 1.0
    return counts


def _save_vocab(trainer: FamilyTrainer, out: Path, source: str) -> None:
    """`out/draft_vocab.json`: the target id of every draft token (`data.draft_vocab` reuses it)."""
    draft: Any = trainer.draft
    ids = draft.d2t + torch.arange(draft.d2t.numel(), device=draft.d2t.device)
    c = draft.config
    body = {"vocab_size": c.vocab_size, "draft_vocab_size": c.draft_vocab_size, "source": source}
    write_json_atomic(TrainDir(out).draft_vocab, {**body, "target_ids": ids.cpu().tolist()})


def _full_draft_state(trainer: FamilyTrainer) -> dict[str, torch.Tensor]:
    """The draft's full (unsharded) state dict on the CPU; collective."""
    sd = get_model_state_dict(trainer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A full model state dict holds tensors only; DCP types its values as any state-dict value.
    return {k.removeprefix("draft."): v for k, v in sd.items() if k.startswith("draft.")}  # type: ignore[misc]


def run_rank(rank: int, world_size: int, job: TrainJob) -> dict[str, Any] | None:
    """Train on this rank; rank 0 returns the summary, the others None."""
    cfg = job.training
    preempt.install()
    if cfg.device == "cpu" and world_size > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    ctx = init_distributed(rank, world_size, job.init_method, cfg.device)
    try:
        return _train(ctx, job)
    finally:
        ctx.close()


@dataclass
class _Run:
    """One rank's training state between steps."""

    ctx: DistContext
    job: TrainJob
    trainer: FamilyTrainer
    optimizer: Any
    scheduler: Any
    ckpt: Checkpointer
    stream: SampleStream
    start_step: int
    window: Window
    step: int = 0
    steps_this_run: int = 0
    tokens_total: float = 0.0
    supervised_total: float = 0.0
    last_stats: StepStats | None = None
    stop_reason: str = ""
    # Prompts this rank trained on (resumed from the checkpoint's ledger part), and SIGUSR2.
    # Each index maps to its content key (`rundir.ledger`; None where the manifest had none).
    trained_prompts: dict[int, str | None] = field(default_factory=dict)
    preempted: bool = False
    feeder: DeviceFeeder | None = None
    last_finish: float = 0.0

    @property
    def cfg(self) -> TrainingConfig:
        return self.job.training

    @property
    def files(self) -> TrainDir:
        return self.job.files

    def save(self) -> None:
        self.stream.sync()  # what the checkpoint counts as trained is durable in the spool first
        self.ckpt.save(
            self.step,
            self.trainer,
            self.optimizer,
            self.scheduler,
            samples_consumed=self.stream.position,
            meta={"family": self.trainer.family},
            prompts=self.trained_prompts,
        )


def _build(ctx: DistContext, job: TrainJob) -> _Run:
    """Trainer, sharding, optimizer, checkpointer, and the resumed position."""
    cfg = job.training
    opener = make_opener(job.samples_source, cfg.seed)
    draft_cfg = load_draft_config(job.draft_config)
    counts = None
    if needs_vocab_counts(draft_cfg):
        if job.draft_vocab:
            counts = _saved_vocab_counts(job.draft_vocab, draft_cfg.vocab_size, draft_cfg.draft_vocab_size)
        else:
            counts = _vocab_counts(job, opener, ctx, draft_cfg.vocab_size)
    trainer = build_trainer(draft_cfg, job.target_dir, cfg, vocab_counts=counts)
    if counts is not None and ctx.is_main:
        how = job.draft_vocab or f"supervised tokens of the first {VOCAB_SCAN_SAMPLES} samples per rank"
        _save_vocab(trainer, job.files.root, how)
    trainer.to(ctx.device)
    shard_trainer(trainer, build_mesh(ctx, cfg.fsdp_mode), cfg)
    optimizer, scheduler = build_optimizer(trainer, cfg)
    ckpt = Checkpointer(job.files.checkpoints, cfg.keep_checkpoints, ctx)

    start_step, position, prompts = 0, {"epoch": 0, "offset": 0}, {}
    # A live attempt resumed from a checkpoint's ledger cannot fall back to an older one.
    live = bool(getattr(job.samples_source, "resumed", False))
    meta = ckpt.load_newest(trainer, optimizer, scheduler, fallback=not live) if job.resume else None
    if meta is not None:
        start_step = int(meta["step"])
        position = meta["samples_consumed"]
        prompts = meta["prompts"]
    stream = SampleStream(opener, ctx.rank, ctx.world_size, **position)
    window = Window(max(1, min(20, cfg.steps // 5)))
    run = _Run(ctx, job, trainer, optimizer, scheduler, ckpt, stream, start_step, window, step=start_step)
    # FSDP casts the inputs to the compute dtype anyway; moving them in it halves the copy.
    run.feeder = DeviceFeeder(ctx.device, torch.bfloat16 if cfg.mixed_precision == "bf16" else torch.float32)
    run.trained_prompts.update(prompts)
    return run


def _prompts_of(samples) -> list[tuple[int | None, str | None]]:
    """Each sample's prompt index and content key (live samples; None where the manifest carries
    none)."""
    out: list[tuple[int | None, str | None]] = []
    for s in samples:
        extra = getattr(getattr(s, "manifest", None), "extra", None) or {}
        out.append((extra.get(PROMPT_KEY), extra.get(CONTENT_KEY)))
    return out


def _launch_step(run: _Run, samples, order_log) -> LaunchedStep:
    """Queue one optimizer step on `samples` (`step.launch`: the host does not wait for it)."""
    cfg, ctx = run.cfg, run.ctx
    batch = collate(
        samples,
        max_seq_len=cfg.max_seq_len,
        min_loss_tokens=cfg.min_loss_tokens,
        pin_memory=ctx.device.type == "cuda",
        step=length_step(cfg.max_seq_len, cfg.compile_lengths) if compile_enabled(cfg) else 1,
    )
    assert run.feeder is not None
    batch = run.feeder.put(batch)
    tagged = _prompts_of(samples)
    prompts = [p for p, _ in tagged]
    record = {"step": run.step + 1, "epoch": run.stream.epoch, "keys": batch.keys, "prompts": prompts}
    order_log.write(json.dumps(record) + "\n")
    order_log.flush()
    launched = launch(run.trainer, run.optimizer, run.scheduler, batch, run.step, ctx, cfg.grad_clip)
    run.step += 1
    run.steps_this_run += 1
    run.trained_prompts.update((p, k) for p, k in tagged if p is not None)
    return launched


def _finish_step(run: _Run, launched: LaunchedStep, step: int) -> tuple[StepStats, dict[str, float]]:
    """Wait for a launched step; its global statistics, refusing a non-finite loss."""
    res = launched.result()
    now = time.monotonic()
    # Steps overlap: a step's time is from the previous step's end (or its own launch) to its end.
    dt = now - max(launched.launched_at, run.last_finish)
    run.last_finish = now
    run.tokens_total += res.tokens
    run.supervised_total += res.supervised_tokens
    stats = StepStats(run.trainer.num_positions, launched.extras, res.stats)
    if not math.isfinite(stats.loss):
        raise FloatingPointError(f"loss is {stats.loss} at step {step}; stopping instead of training on it")
    scalars = {
        "grad_norm": res.grad_norm,
        "lr": launched.lr,
        "tokens_per_s": res.tokens / max(dt, 1e-9),
        "tokens_per_s_per_rank": res.tokens / max(dt, 1e-9) / run.ctx.world_size,
        "supervised_tokens": res.supervised_tokens,
    }
    return stats, scalars


def _report(run: _Run, step: int, stats: StepStats, scalars: dict[str, float], tb, bar) -> None:
    run.window.add(stats)
    run.last_stats = stats
    if not run.ctx.is_main:
        return
    if step % run.cfg.log_every == 0 or step == run.cfg.steps:
        tb.log(step, stats, scalars)
    if bar is not None:
        bar.step(step, stats, scalars, run.tokens_total, run.window)


def _train_steps(run: _Run) -> None:
    """Steps until `training.steps`, `stop_after`, or the samples run out (`run.stop_reason`).

    The device runs one step ahead of the host: step `n + 1` is read and queued before step `n`'s
    statistics are read (`step.py`), and every step is finished before a checkpoint or the end.
    """
    cfg, ctx, job = run.cfg, run.ctx, run.job
    tb = TensorBoardLog(run.files.tensorboard, enabled=ctx.is_main)
    bar = None
    if ctx.is_main:
        bar = TrainProgress(
            family=run.trainer.family,
            total=cfg.steps,
            start_step=run.start_step,
            samples_per_step=cfg.batch_size * ctx.world_size,
            every_s=cfg.progress_every_s,
            record=job.progress_file,
            bar=job.show_progress,
        )
    order_path = run.files.order_log(ctx.rank)
    order_path.parent.mkdir(parents=True, exist_ok=True)
    _truncate_order(order_path, run.start_step)
    pending: tuple[LaunchedStep, int] | None = None

    def finish() -> None:
        nonlocal pending
        if pending is not None:
            launched, step = pending
            pending = None
            _report(run, step, *_finish_step(run, launched, step), tb, bar)

    # The pacing hook holds the first attempt only: a requeued one has no wall-clock moment to wait for.
    min_step_s = float(envs.get(envs.HPCTOOLKIT_MIN_STEP_S.name) or 0) if restart_count() == 0 else 0.0
    last_start = 0.0
    # Which samples each step read, per rank: what resume is checked against.
    with order_path.open("a") as order_log:
        while run.step < cfg.steps:
            if job.stop_after is not None and run.steps_this_run >= job.stop_after:
                run.stop_reason = "stop_after"
                break
            if min_step_s > 0:  # a test's pace (envs.py); SIGUSR2 is still seen at the next read
                time.sleep(max(0.0, last_start + min_step_s - time.monotonic()))
                last_start = time.monotonic()
            samples, asked = _next_samples(run)
            # One collective: does every rank have a batch, and was any rank asked to stop?
            ok = _all_ranks(ctx, samples is not None, not asked)
            if not ok[1]:
                run.preempted = True
                run.stop_reason = f"preempted (SIGUSR2) at step {run.step}"
                break
            if not ok[0]:
                run.stop_reason = f"samples source exhausted at step {run.step}"
                break
            launched = _launch_step(run, samples, order_log)
            finish()
            pending = (launched, run.step)
            if run.step % cfg.checkpoint_every == 0 or run.step == cfg.steps:
                finish()
                run.save()
    finish()
    if bar is not None:
        bar.close()
    tb.close()


def _all_ranks(ctx: DistContext, *flags: bool) -> list[bool]:
    """Each flag ANDed over ranks, on the host-side group (no wait for the device's queue)."""
    if ctx.world_size == 1:
        return list(flags)
    t = torch.tensor([1.0 if f else 0.0 for f in flags])
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=ctx.host_group)
    return [bool(x) for x in t.tolist()]


def _next_samples(run: _Run) -> tuple[list[Any] | None, bool]:
    """This rank's next batch, and whether SIGUSR2 asked it to stop (the batch is then dropped:
    it was never trained on, and the next attempt reads it again)."""
    if preempt.requested():
        return None, True
    before = run.stream.position
    try:
        with preempt.interruptible():
            samples = run.stream.next_batch(run.cfg.batch_size)
    except preempt.Preempted:
        samples = None
    except Exception as err:
        if not preempt.requested():
            raise
        # The engines (or the store) went away with the same notice; the checkpoint does not need them.
        log.warning("reading samples failed after SIGUSR2 (%s); checkpointing", err)
        samples = None
    if not preempt.requested():
        return samples, False
    # The checkpoint's position is that of the last trained batch: this one is read again.
    run.stream.rewind(before)
    return None, True


def _truncate_order(path: Path, start_step: int) -> None:
    """Keep only the steps up to the checkpoint a run resumed from (a crash may have logged more).
    Rewritten atomically: a crash here must not lose the steps the checkpoint trained on."""
    if start_step and not path.exists():
        return
    lines = path.read_text().splitlines() if start_step else []
    kept = [x for x in lines if x.strip() and json.loads(x)["step"] <= start_step]
    write_text_atomic(path, "".join(x + "\n" for x in kept))


def _train(ctx: DistContext, job: TrainJob) -> dict[str, Any] | None:
    run = _build(ctx, job)
    t_start = time.monotonic()
    with GpuBusy(ctx.device) as busy:  # the summary's `gpu_busy`: a starved input path shows
        _train_steps(run)
    wall = time.monotonic() - t_start
    cfg = run.cfg
    if run.preempted:
        preempt.request()  # every rank that stopped for it, asked or not (`roles.trainer`)
        t0 = time.monotonic()
        latest = run.ckpt.latest()
        if run.step > run.start_step and (latest is None or int(latest.name.split("-")[1]) != run.step):
            run.save()
            if ctx.is_main:
                log.warning(
                    "SIGUSR2: checkpoint of step %d written in %.1fs", run.step, time.monotonic() - t0
                )
        elif ctx.is_main:
            log.warning(
                "SIGUSR2 at step %d: no step trained since the last checkpoint, none written", run.step
            )
    elif run.step < cfg.steps and run.stop_reason != "stop_after" and run.step > run.start_step:
        run.save()  # data ran out early: keep what was trained
    export_dir, export_error = None, None
    if cfg.export and run.stop_reason != "stop_after" and not run.preempted:
        state = _full_draft_state(run.trainer)
        if ctx.is_main:
            cpu_draft = _save_training_format(run.trainer, state, run.files)
            try:
                export_dir = _export(cpu_draft, run.files)
            except ConfigError as err:
                # The trained draft is kept (out/draft, checkpoints); only vLLM cannot serve it.
                export_error = str(err)
                log.error("export to %s refused: %s", run.files.export, err)
    ctx.barrier()
    if not ctx.is_main:
        return None
    summary = _summary(run, wall) | busy.fields()
    if export_dir is not None:
        summary["export_dir"] = str(export_dir)
    if export_error is not None:
        summary["export_error"] = export_error
    summary = carry_forward(summary, read_json(run.files.summary))  # a resume keeps earlier figures
    write_json_atomic(run.files.summary, summary, indent=2)
    return summary


def _summary(run: _Run, wall: float) -> dict[str, Any]:
    ctx, files, trainer = run.ctx, run.files, run.trainer
    total = run.window.total()
    summary: dict[str, Any] = {
        "family": trainer.family,
        "steps_trained": run.step,
        "steps_this_run": run.steps_this_run,
        "resumed_from_step": run.start_step,
        "final_loss": run.last_stats.loss if run.last_stats else None,
        **trainer_figures(total),  # acceptance_length at the draft's depth, and at every k
        "train_tokens_per_s": run.tokens_total / max(wall, 1e-9),
        # Tokens the loss could be computed on (loss mask 1), over every rank, this invocation.
        "supervised_tokens": int(run.supervised_total),
        "train_tokens_per_s_per_rank": run.tokens_total / max(wall, 1e-9) / ctx.world_size,
        "world_size": ctx.world_size,
        "stop_reason": run.stop_reason or "completed",
        "preempted": run.preempted,
        "samples_position": run.stream.position,
        "checkpoint_dir": str(run.ckpt.latest()) if run.ckpt.latest() else None,
        "draft_dir": str(files.draft) if files.draft.is_dir() else None,
        "tensorboard_dir": str(files.tensorboard),
    }
    if total is not None:
        summary["train_window_steps"] = total.steps
        summary["train_metrics"] = total.summary()
        summary["acceptance_plot"] = str(
            plot_acceptance(
                files.acceptance_plot,
                acceptance_rate_per_pos=total.acceptance_rate_per_pos(),
                accuracy_per_pos=total.pos_accuracy(),
                title=f"{trainer.family}: acceptance length {figure(total.acceptance_length_incl_bonus(), 2)}"
                f" (incl. bonus), last {total.steps} steps",
            )
        )
    return summary


def _save_training_format(
    trainer: FamilyTrainer, state: dict[str, torch.Tensor], files: TrainDir
) -> DraftModel:
    """`out/draft`: the full draft under our module names (what `python -m hpctoolkit.export` reads)."""
    cpu_model = build_draft_model(trainer.draft.config)
    missing, unexpected = cpu_model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(
            f"gathered draft state does not match the model: missing {missing}, unexpected {unexpected}"
        )
    save_draft(cpu_model, files.draft)
    return cpu_model


def _export(cpu_draft: DraftModel, files: TrainDir) -> Path:
    """`out/export`: the vLLM serving checkpoint, through the models' `export_draft`."""
    return export_draft(cpu_draft, cpu_draft.config, files.export)
