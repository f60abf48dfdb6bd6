"""The pure parts of `benchmarks/pp_export.py`: which statistic decides the target, the PP=1 core split."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "pp_export.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("pp_export_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _results(pipe_on_bytes=512 * 10, keys=("hidden_states", "residual")):
    out = {}
    for pp in (1, 2):
        for mode in ("plain", "export"):
            on = mode == "export"
            out[(pp, mode)] = {
                "tokens_per_s": 1000.0,
                "wall_s": 1.0,
                "publish_wait_s": 0.01,
                "pipe": [{"bytes": pipe_on_bytes if on else 512 * 10, "keys": list(keys)}],
                "pipe_tokens": 10,
                "engine_start_s": 1.0,
            }
    return out


def test_target_reads_the_pooled_median_of_paired_ratios(bench):
    # One pair's median is over the target, but the pooled median is under it.
    paired = {1: [[1.10, 1.12, 1.30, 1.40], [1.05, 1.08, 1.09, 1.11]], 2: [[1.10, 1.10]]}
    text, ok = bench.report(_results(), [1, 2], paired)
    assert ok, text
    assert "1.105x" in text  # PP=1: eight ratios pooled, median (1.10 + 1.11) / 2
    paired[2] = [[1.14, 1.16, 1.20]]
    _, ok = bench.report(_results(), [1, 2], paired)
    assert not ok


def test_extra_pipe_bytes_or_aux_keys_fail(bench):
    paired = {1: [[1.0]], 2: [[1.0]]}
    assert bench.report(_results(), [1, 2], paired)[1]
    assert not bench.report(_results(pipe_on_bytes=600 * 10), [1, 2], paired)[1]
    aux = ("hidden_states", "residual", "aux_hidden_states_0")
    assert not bench.report(_results(keys=aux), [1, 2], paired)[1]


@pytest.mark.parametrize(("cores", "bind"), [(1, "0"), (2, "0"), (3, "0-1"), (16, "0-14")])
def test_pp1_engine_leaves_one_core_free(bench, cores, bind):
    assert bench.pp1_bind(cores) == bind


def test_quartiles(bench):
    assert bench.quartiles([1.0]) == (1.0, 1.0, 1.0)
    q1, med, q3 = bench.quartiles([1.0, 2.0, 3.0, 4.0, 5.0])
    assert (q1, med, q3) == (2.0, 3.0, 4.0)
