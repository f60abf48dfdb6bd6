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
