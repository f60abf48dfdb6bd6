"""`benchmarks/acceptance.py` without running a job: the points it reads back, `--no-run`."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def acceptance():
    spec = importlib.util.spec_from_file_location("acceptance", ROOT / "benchmarks" / "acceptance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _point(out: Path, name: str, served: float) -> None:
    latest = out / name / "latest"
    latest.mkdir(parents=True)
    summary = {
        "supervised_tokens": 1000,
        "served_acceptance_length": served,
        "served_acceptance_by_category": {"writing": served, "math": served + 0.1},
        "acceptance_length": 2.0,
        "wall_seconds": 12.0,
    }
    (latest / "summary.json").write_text(json.dumps(summary))


def test_no_run_tables_and_plots_what_ran_and_names_the_rest(acceptance, tmp_path, capsys):
    _point(tmp_path, "dflash-64x200", 1.09)
    _point(tmp_path, "eagle3-64x200", 1.19)
    argv = [
        "--no-run",
        "--points",
        "64:200,128:300",
        "--out",
        str(tmp_path),
        "--plot",
        str(tmp_path / "a.png"),
    ]
    assert acceptance.main(argv) == 0
    text = capsys.readouterr().out
    assert "dflash 128:300 not run" in text and "eagle3 128:300 not run" in text
    rows = json.loads((tmp_path / "acceptance.json").read_text())
    assert [(r["family"], r["samples"], r["served"]) for r in rows] == [
        ("dflash", 64, 1.09),
        ("eagle3", 64, 1.19),
    ]
    assert (tmp_path / "a.png").stat().st_size > 0


def test_points_are_samples_colon_steps(acceptance):
    assert acceptance.parse_points("64:200,256:800") == [(64, 200), (256, 800)]
    with pytest.raises(SystemExit, match="SAMPLES:STEPS"):
        acceptance.parse_points("64x200")


def test_a_rungs_row_is_small_and_the_ladders_table_is_drawn_from_the_recorded_rows(
    acceptance, tmp_path, capsys
):
    out = tmp_path / "acc"
    logs = out / "dflash-4096x2048" / "latest" / "logs"
    logs.mkdir(parents=True)
    (logs / "regenerate-engine0.json").write_text(
        json.dumps({"turns": 4096, "truncated": 900, "degenerate": 12})
    )
    summary = {
        "supervised_tokens": 5_000_000,
        "served_acceptance_length": 1.8,
        "served_acceptance_by_category": {"writing": 1.7, "math": 1.9},
        "served_acceptance_by_turn": {"1": 1.8, "2": 1.8},
        # As a run's summary keeps them: the first set's rates under `evaluate`, each set's counters.
        "evaluate": {"served_per_position_acceptance": [0.5, 0.2, 0.1]},
        "per_set": {
            "mt_bench": {
                "served_acceptance_length": 1.8,
                "served_acceptance_by_category": {"writing": 1.7},
                "counters": {
                    "vllm:spec_decode_num_drafts": 200,
                    "vllm:spec_decode_num_accepted_tokens_per_pos": [100, 40, 20],
                },
            },
            "human_eval": {"served_acceptance_length": 2.1},
        },
        "acceptance_length_at_served_k": 2.4,
        "wall_seconds": 800.0,
        "train_wall_seconds": 300.0,
        "phases_s": {"regenerate": 120.0, "train": 300.0},
        "gpu_busy": {"share": 0.93, "samples": 600},
        "recipe": "local_gpu",
    }
    row = acceptance.ladder_row("dflash", 4096, 2048, summary, out)
    assert row["served"]["human_eval"]["tau"] == 2.1 and row["served"]["mt_bench"]["tau"] == 1.8
    assert row["regenerated"] == {"turns": 4096, "truncated": 900, "degenerate": 12}
    assert row["seconds"]["phases"]["regenerate"] == 120.0 and row["gpu_busy"]["share"] == 0.93
    assert row["gpu_seconds"] == 800.0 and row["epochs"] == 8.0
    assert row["served_per_position"] == [0.5, 0.2, 0.1]
    assert row["served"]["mt_bench"]["per_position"] == [0.5, 0.2, 0.1]
    assert row["served"]["human_eval"]["per_position"] is None  # no counters recorded
    assert len(json.dumps(row)) < 2000  # no data, no weights
    record = tmp_path / "ladder.jsonl"
    record.write_text(json.dumps(row) + "\n")
    argv = [
        "--ladder",
        "--no-run",
        "--record",
        str(record),
        "--out",
        str(tmp_path / "o"),
        "--families",
        "dflash",
    ]
    assert acceptance.main(argv) == 0
    text = capsys.readouterr().out
    assert "4096" in text and "1.80" in text and "2.10" in text
