"""`python -m hpctoolkit.recipe.preview`: the samples as the trainer sees them, on the tiny target's
template and on a tokenizer directory given as paths.target_model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)

MSG = {
    "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "the cat"},
        {"role": "assistant", "content": "sat on the mat"},
    ]
}


def preview(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hpctoolkit.recipe.preview", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "chat.jsonl"
    p.write_text(json.dumps(MSG) + "\n" + json.dumps({"text": "the dog ran"}) + "\n")
    return p


def test_json_on_the_tiny_target(data_file):
    r = preview(
        "recipes/tiny.yaml", f"data.prompts={data_file}", "-n", "2", "--json", "data.regenerate_tokens=0"
    )
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(rows) == 2 and set(rows[0]) == {"origin", "text", "input_ids", "loss_mask"}
    assert rows[0]["text"].startswith("<|im_start|>system\nbe brief<|im_end|>")
    assert len(rows[0]["input_ids"]) == len(rows[0]["loss_mask"]) and all(rows[1]["loss_mask"])


def test_marked_text_and_a_tokenizer_directory(data_file, tmp_path):
    from hpctoolkit.targets.builtin import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    tok.save_pretrained(tmp_path / "tok")
    r = preview(
        "recipes/tiny.yaml", f"paths.target_model={tmp_path / 'tok'}", f"data.prompts={data_file}", "-n", "1"
    )
    assert r.returncode == 0, r.stderr
    # The space the tokenizer merges into the first content token is supervised with it.
    assert "[assistant][[ sat on the mat<|im_end|>]]" in r.stdout
    assert "1 supervised" not in r.stdout and "supervised" in r.stdout


def test_a_malformed_row_is_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    r = preview("recipes/tiny.yaml", f"data.prompts={bad}", "-n", "1")
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "bad.jsonl: row 0: field 'messages[0].role'" in lines[0]
