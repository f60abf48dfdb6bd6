"""Rules that tie recipe sections together, checked in one place at load.

They read the target's `config.json` (a packaged target's GGUF header until it is converted) and
the draft config JSON: small reads, and nothing is written (`targets.resolve.target_hf_config`).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import TYPE_CHECKING, Any

from hpctoolkit.capture.layout import capture_ids_for, check_every_stage_captures
from hpctoolkit.config.draft import draft_target_layer_ids
from hpctoolkit.errors import ConfigError
from hpctoolkit.models.families import serving_for
from hpctoolkit.plan.sizing import StoreSizing, size_store
from hpctoolkit.recipe.schema import LAYER_FIELDS, RecipeConfig
from hpctoolkit.rundir.atomic import read_json_object
from hpctoolkit.targets.resolve import num_hidden_layers, target_hf_config

if TYPE_CHECKING:
    from hpctoolkit.plan.placement import Plan


def _check_family_rules(cfg: RecipeConfig, draft: dict[str, Any]) -> None:
    """The rules a draft family adds to the recipe, read from its `Serving` record."""
    try:
        serving = serving_for(draft)
    except ConfigError as err:
        raise ConfigError(f"draft.config: {cfg.draft.config}: {err}") from None
    if serving.min_loss_tokens is not None:
        floor, why = serving.min_loss_tokens(draft)
        if cfg.training.min_loss_tokens < floor:
            raise ConfigError(f"training.min_loss_tokens={cfg.training.min_loss_tokens} must be >= {why}")


def check_layer_fields(cfg: RecipeConfig, target_layers: int, draft: dict[str, Any]) -> None:
    """Every field that names layers (`schema.LAYER_FIELDS`) against the depth of the target
    and of the draft (its `num_hidden_layers`; unchecked where its config leaves it out)."""
    draft_layers = draft.get("num_hidden_layers")
    depths = {
        "target": (target_layers, cfg.paths.target_model),
        "draft": (draft_layers if isinstance(draft_layers, int) else None, cfg.draft.config),
    }
    for key, layers in LAYER_FIELDS.items():
        layers.check(key, operator.attrgetter(key)(cfg), depths)


def fill_from_draft(cfg: RecipeConfig) -> RecipeConfig:
    """The recipe with what it leaves to the draft filled in: an empty `engine.target_layer_ids`
    becomes the draft's (a new config; `cfg` is not changed)."""
    if cfg.engine.target_layer_ids:
        return cfg
    draft_ids = draft_target_layer_ids(read_json_object(cfg.draft.config, "draft.config"))
    if draft_ids is None:
        raise ConfigError(f"draft.config: {cfg.draft.config} names no target_layer_ids")
    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, target_layer_ids=list(draft_ids)))


def _check_sample_lengths(cfg: RecipeConfig) -> None:
    """The longest sample the data can make (a prompt, or a regenerated turn's history, of at most
    `data.max_prompt_tokens`, plus at most `data.regenerate_tokens` of answer) must fit the engine,
    which captures at most `engine.max_model_len - 1` tokens, and the trainer, which would cut it:
    found at load, not on an engine node or as silently shortened samples."""
    d = cfg.data
    longest = d.max_prompt_tokens + d.regenerate_tokens
    what = f"data.max_prompt_tokens + data.regenerate_tokens = {d.max_prompt_tokens} + {d.regenerate_tokens}"
    if longest >= cfg.engine.max_model_len:
        raise ConfigError(
            f"{what} = {longest} tokens, a sample the engine cannot capture: engine.max_model_len="
            f"{cfg.engine.max_model_len} holds at most {cfg.engine.max_model_len - 1}; raise "
            f"engine.max_model_len above {longest} or lower data.max_prompt_tokens"
        )
    if cfg.training.max_seq_len < longest:
        raise ConfigError(
            f"{what} = {longest} tokens, but training.max_seq_len={cfg.training.max_seq_len} would cut "
            f"such a sample; raise training.max_seq_len to at least {longest} or lower data.max_prompt_tokens"
        )


def store_sizing(cfg: RecipeConfig, plan: Plan | None = None) -> StoreSizing:
    """The store, spool and memory figures of `cfg` against its target (`plan.sizing.size_store`;
    with a Slurm `plan`, each node's memory too); raises `ConfigError` where they do not fit."""
    return size_store(cfg, target_hf_config(cfg.paths.target_model), plan)


def check_couplings(cfg: RecipeConfig) -> None:
    """The rules across sections (they read the target's and the draft's configs). Pure: raises
    `ConfigError` naming the key, changes nothing."""
    target = target_hf_config(cfg.paths.target_model)
    num_layers = num_hidden_layers(target)
    e = cfg.engine
    if e.pp_size > num_layers:
        raise ConfigError(f"engine.pp_size={e.pp_size} exceeds the target's {num_layers} layers")

    draft = read_json_object(cfg.draft.config, "draft.config")
    check_layer_fields(cfg, num_layers, draft)
    draft_ids = draft_target_layer_ids(draft)
    if draft_ids is None:
        raise ConfigError(f"draft.config: {cfg.draft.config} names no target_layer_ids")
    if list(e.target_layer_ids) != draft_ids:
        raise ConfigError(
            f"engine.target_layer_ids={list(e.target_layer_ids)} differ from the draft's target_layer_ids "
            f"{draft_ids} in {cfg.draft.config}; the engine must capture exactly the layers the draft reads"
        )
    try:
        capture = capture_ids_for(e.target_layer_ids, num_layers)
        if e.pp_size > 1:
            check_every_stage_captures(capture, num_layers, e.pp_size)
    except ConfigError as err:
        raise ConfigError(f"engine.target_layer_ids: {err}") from err

    want_hidden = draft.get("target_hidden_size")
    if want_hidden is not None and want_hidden != target.get("hidden_size"):
        raise ConfigError(
            f"draft.config: target_hidden_size={want_hidden} but the target's hidden_size is {target.get('hidden_size')}"
        )

    _check_sample_lengths(cfg)
    _check_family_rules(cfg, draft)
    # The store must hold what the engines may have in flight; counts must agree (plan.sizing).
    store_sizing(cfg)
