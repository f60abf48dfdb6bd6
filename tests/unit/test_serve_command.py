"""The `vllm serve` command a run prints for its export (`evaluate.command`): pure."""

import json
import shlex

import pytest

from hpctoolkit.evaluate.command import serve_argv, serve_line


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
