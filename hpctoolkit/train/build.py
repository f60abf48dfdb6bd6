# ruff: noqa: N803  -- shape-suffixed tensor names (hidden_BSH), per STYLE.md
"""Building a family's trainer: the draft (embedding and head from the target) + the target head.

The trainer class comes from the draft registry (`models.registry.trainer_class_for`), keyed by
the draft's family; what differs by family is a class attribute of the trainer (`unused_options`,
`prunes_vocab`), never a branch here. The trainer gets the training options it reads as
`TrainerOptions` (`trainer_options`), so the families never see `TrainingConfig`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.common.config import DraftConfig
from hpctoolkit.models.common.draft import DraftModel
from hpctoolkit.models.common.trainer import FamilyTrainer, TrainerOptions
from hpctoolkit.models.common.vocab import draft_vocab_from_counts
from hpctoolkit.models.registry import build_draft_model, load_draft_config, trainer_class_for
from hpctoolkit.train.config import TrainingConfig
from hpctoolkit.train.target_head import TargetHead, read_target_layer_tensor, read_target_tensor

log = logging.getLogger(__name__)


def trainer_options(cfg: TrainingConfig) -> TrainerOptions:
    """The options a family's hooks read, out of the training section."""
    return TrainerOptions(
        seed=cfg.seed, ttt_length=cfg.ttt_length, num_anchors=cfg.num_anchors, label_source=cfg.label_source
    )


def warn_unused_options(config: DraftConfig, cfg: TrainingConfig) -> list[str]:
    """Training options that have no effect on this family, logged once (and returned)."""
    default = TrainingConfig()
    unused = [n for n in trainer_class_for(config).unused_options if getattr(cfg, n) != getattr(default, n)]
    for name in unused:
        log.warning(
            "training.%s=%r has no effect on a %s draft", name, getattr(cfg, name), type(config).__name__
        )
    return unused


def needs_vocab_counts(config: DraftConfig) -> bool:
    """Whether the draft prunes its vocabulary, so training first counts the data's tokens."""
    return trainer_class_for(config).prunes_vocab and config.draft_vocab_size < config.vocab_size


def check_draft_against_target(config: DraftConfig, head: TargetHead) -> None:
    if config.vocab_size != head.vocab_size:
        raise ConfigError(
            f"draft.config: vocab_size={config.vocab_size} but the target's lm_head has {head.vocab_size} rows"
        )
    trainer_cls = trainer_class_for(config)
    if not trainer_cls.prunes_vocab and config.draft_vocab_size != config.vocab_size:
        raise ConfigError(
            f"draft.config: draft_vocab_size={config.draft_vocab_size} != vocab_size for a "
            f"{trainer_cls.family} draft; only Eagle3 prunes its vocabulary"
        )


@torch.no_grad()
def init_from_target(draft: DraftModel, head: TargetHead, embed_VH: torch.Tensor | None) -> None:
    """Copy the target's input embedding and output head into the draft (both frozen or seeded).

    `embed_VH` None means the target is tied: its head is its embedding. A pruned Eagle3 head is
    seeded from the target rows of its draft vocabulary (`d2t` must be installed first).
    """
    emb = head.lm_head_VH if embed_VH is None else embed_VH
    draft.embed_tokens.weight.copy_(emb.to(draft.embed_tokens.weight))
    rows = head.lm_head_VH
    lm = draft.lm_head.weight
    if lm.shape[0] != rows.shape[0]:
        d2t = draft.get_buffer("d2t")  # the pruned families' draft -> target offsets
        ids = d2t + torch.arange(d2t.numel(), device=d2t.device)
        rows = rows.index_select(0, ids.to(rows.device))
    lm.copy_(rows.to(lm))


def build_trainer(
    draft_config: str | os.PathLike | DraftConfig,
    target: str | os.PathLike | TargetHead,
    cfg: TrainingConfig,
    *,
    vocab_counts: torch.Tensor | None = None,
    device: str | torch.device | None = None,
) -> FamilyTrainer:
    """Draft (fresh init, embedding and head from the target) + frozen target head.

    Built directly on `device` (default: the CPU), so a multi-billion-parameter draft is not
    initialised on the host first.

    `target` is a target model directory (only the head tensors are read) or a ready
    `TargetHead` (synthetic benchmarks). `vocab_counts` `[V]` token counts choose a pruned
    Eagle3 vocabulary; without them the first `draft_vocab_size` ids are used.
    """
    config = draft_config if isinstance(draft_config, DraftConfig) else load_draft_config(draft_config)
    torch.manual_seed(cfg.seed)
    if isinstance(target, TargetHead):
        head, embed = target, None
    else:
        head = TargetHead.from_pretrained(target)
        embed = read_target_tensor(Path(target), "embed_tokens.weight")
    check_draft_against_target(config, head)
    warn_unused_options(config, cfg)
    draft = build_draft_model(config, device=device)
    head = head.to(device) if device is not None else head
    trainer_cls = trainer_class_for(config)
    if needs_vocab_counts(config):
        counts = (
            vocab_counts
            if vocab_counts is not None
            else -torch.arange(config.vocab_size, dtype=torch.float64)
        )
        draft.set_vocab_mapping(draft_vocab_from_counts(counts, config.draft_vocab_size))
    init_from_target(draft, head, embed)
    if cfg.init_layers_from_target:
        if isinstance(target, TargetHead):
            raise ConfigError("training.init_layers_from_target needs a target directory, not a bare head")
        init_layers_from_target(draft, Path(target), cfg.init_layers_from_target)
    return trainer_cls(draft, head, trainer_options(cfg))


def init_layers_from_target(draft: DraftModel, target_dir: Path, layer_ids: list[int]) -> list[str]:
    """Copy target layer `layer_ids[i]` into draft layer `i` where names and shapes agree, and the
    target's final norm into the draft's; returns the draft parameters set. A draft without that
    many layers, a layer the target lacks, or a layer sharing nothing is a one-line error."""
    layers = getattr(draft, "layers", None)
    if layers is None or len(layer_ids) > len(layers):
        have = 0 if layers is None else len(layers)
        raise ConfigError(
            f"training.init_layers_from_target lists {len(layer_ids)} layers; the draft has {have} decoder layers"
        )
    copied = []
    params = dict(draft.named_parameters())
    with torch.no_grad():
        for i, t in enumerate(layer_ids):
            got = []
            for name, p in params.items():
                if not name.startswith(f"layers.{i}."):
                    continue
                src = read_target_layer_tensor(target_dir, t, name.removeprefix(f"layers.{i}."))
                if src is not None and tuple(src.shape) == tuple(p.shape):
                    p.copy_(src.to(p))
                    got.append(name)
            if not got:
                raise ConfigError(
                    f"training.init_layers_from_target: target layer {t} of {target_dir} has no tensor "
                    f"matching draft layer {i} (a layer index the target lacks, or other shapes)"
                )
            copied += got
        norm = params.get("norm.weight")
        src = read_target_tensor(target_dir, "norm.weight")
        if norm is not None and src is not None and src.shape == norm.shape:
            norm.copy_(src.to(norm))
            copied.append("norm.weight")
    return copied
