"""What the bad-input tests share: the tiny recipe's arguments, and the submit CLI run as a user
runs it, which must refuse in one line with exit 2 (`fails`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctoolkit.cli import run_cli
from hpctoolkit.submit import main

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "recipes" / "tiny.yaml"
DRAFT = REPO / "recipes" / "draft_models" / "tiny_dflash.json"


def base(tmp_path: Path) -> list[str]:
    return [str(TINY), f"paths.output_dir={tmp_path / 'out'}", f"draft.config={DRAFT}"]


def fails(capsys: pytest.CaptureFixture[str], argv: list[str], *, dry_run: bool = True) -> str:
    """Run the submit CLI; it must exit 2 with exactly one line, returned without `error: `."""
    with pytest.raises(SystemExit) as done:
        run_cli(main, [*argv, "--dry-run"] if dry_run else argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert done.value.code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0].removeprefix("error: ")
