"""The `vllm serve` command a run prints for its export (`evaluate.command`), and the warning
said beside it past the depth the draft was trained for: pure."""

import json
import shlex
import shutil
from pathlib import Path

import pytest

from hpctoolkit.errors import ConfigError
from hpctoolkit.evaluate.command import k_warning, serve_argv, serve_line

DRAFTS = Path(__file__).resolve().parents[2] / "recipes" / "draft_models"


def test_the_command_names_target_export_method_and_k():
    argv = serve_argv("/runs/r1/export", "/models/smollm2", method="dflash", num_speculative_tokens=3)
    assert argv[:3] == ["vllm", "serve", "/models/smollm2"]
    assert argv[3] == "--speculative-config"
    assert json.loads(argv[4]) == {
        "method": "dflash",
        "model": "/runs/r1/export",
        "num_speculative_tokens": 3,
    }


def test_the_line_round_trips_through_a_shell_with_awkward_paths():
    argv = serve_argv(
        "/runs/it's here/export",
        "/models/a b",
        method="eagle3",
        num_speculative_tokens=5,
        extra=["--port", "8001"],
    )
    line = serve_line(argv)
    assert shlex.split(line) == argv
    assert line.endswith("--port 8001")


def test_k_below_one_is_refused():
    with pytest.raises(ValueError, match="num_speculative_tokens must be at least 1, got 0"):
        serve_argv("e", "t", method="dflash", num_speculative_tokens=0)


def test_a_k_past_the_trained_depth_is_warned_about_naming_the_draft_and_both_numbers():
    dflash = DRAFTS / "tiny_dflash.json"  # block_size 4
    assert k_warning(dflash, 5) == (
        "serving k=5 speculative tokens with the DFlash draft, trained for 3 (block_size 4): "
        "positions past 3 were never trained"
    )
    assert k_warning(dflash, 3) is None and k_warning(dflash, 1) is None
    assert k_warning(DRAFTS / "tiny_k3_dspark_mla.json", 7) == (
        "serving k=7 speculative tokens with the K3 DSpark MLA draft, trained for 6 (block_size 7): "
        "positions past 6 were never trained"
    )
    eagle3 = json.loads((DRAFTS / "tiny_eagle3.json").read_text())
    assert k_warning(eagle3, 8, ttt_length=7) == (
        "serving k=8 speculative tokens with the Eagle3 draft, trained for 7 (training.ttt_length 7): "
        "positions past 7 were never trained"
    )
    assert k_warning(eagle3, 7, ttt_length=7) is None
    assert k_warning(eagle3, 64) is None  # its depth is unknown without the run's ttt_length


def test_the_evaluate_cli_warns_on_stderr_before_it_serves(tmp_path, monkeypatch, capsys):
    from hpctoolkit.evaluate import __main__ as cli

    export = tmp_path / "export"
    export.mkdir()
    shutil.copy(DRAFTS / "tiny_dflash.json", export / "config.json")

    def serving_starts(spec):
        raise ConfigError("serving starts here")

    monkeypatch.setattr(cli, "resolve_target", serving_starts)
    for k, warned in (("5", True), ("3", False)):
        with pytest.raises(ConfigError, match="serving starts here"):
            cli.main([str(export), "--target", "t", "--num-speculative-tokens", k])
        err = capsys.readouterr().err
        assert (err == f"hpctoolkit: warning: {k_warning(export, 5)}\n") if warned else not err
