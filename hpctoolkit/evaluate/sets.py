"""The chat sets `evaluate.sets` names, each a loader of its questions (`mt_bench.Question`).

One registry: its names are the config's (`recipe.schema.EVAL_SETS`, which a test holds equal),
and a name it lacks is refused with the valid ones listed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hpctoolkit.errors import ConfigError
from hpctoolkit.evaluate import human_eval, mt_bench
from hpctoolkit.evaluate.mt_bench import Question
from hpctoolkit.output.figures import figure


def _mt_bench(questions_per_category: int) -> list[Question]:
    return mt_bench.select(mt_bench.load_questions(), questions_per_category)


def _human_eval(questions_per_category: int) -> list[Question]:
    del questions_per_category  # HumanEval has no categories: all 164 problems
    return human_eval.as_questions(human_eval.load_problems())


LOADERS: dict[str, Callable[[int], list[Question]]] = {
    "mt_bench": _mt_bench,
    "human_eval": _human_eval,
}


def load_sets(
    names: Sequence[str], questions_per_category: int = mt_bench.PER_CATEGORY
) -> dict[str, list[Question]]:
    """The questions of each named set, in the order named; an unknown or repeated name is refused."""
    unknown = [n for n in names if n not in LOADERS]
    if unknown or not names:
        raise ConfigError(f"evaluate.sets must name one or more of {list(LOADERS)}, got {list(names)}")
    if len(set(names)) != len(names):
        raise ConfigError(f"evaluate.sets names a set twice: {list(names)}")
    return {n: LOADERS[n](questions_per_category) for n in names}


def set_lines(per_set: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The terminal's per-set report (`per_set` of a result): a set a line, with its question count."""
    lines = []
    for name, s in per_set.items():
        v = s["served_acceptance_length"]
        lines.append(f"{name} ({s['num_questions']} questions): served acceptance length {figure(v)}")
    return lines
