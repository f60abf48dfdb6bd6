"""Acceptance: a hybrid target's hidden states exported at PP=2 and PP=3 are bitwise those of PP=1.

A hybrid target, to vLLM, is one whose attention layers do not share one KV cache spec; vLLM then
forms one KV cache group per spec, and gives each distinct hidden-state cache layer a group of its
own. Before the patch gave every stage one cache layer name and head count, every worker saw
pp_size hidden-state groups and the connector could not be built (Kimi-K3, DeepSeek-V4 and
MiniMax-M3 at PP > 1). `tiny-llama-hybrid` alternates sliding-window and full-attention layers;
prompts longer than its window exercise both. The arms are `test_vllm_pp_equivalence`'s (each its
own process, one request per `generate()`, through connector -> Mooncake -> dataset).

    python tests/e2e/test_vllm_pp_hybrid.py [--pp 2 3]     # standalone, prints the table
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_vllm_pp_equivalence import PROMPT_LENGTHS, report, run_all

TARGET = "builtin:tiny-llama-hybrid"
# vLLM logs the KV cache groups it formed (kv_cache_utils.py), one size per group.
GROUP_LINE = re.compile(r"kv cache group sizes \(([\d, ]+)\)")


def kv_cache_groups(work: Path) -> dict[str, set[int]]:
    """Per arm log: the numbers of KV cache groups vLLM reported forming."""
    return {
        log.name: {len(m.split(",")) for m in GROUP_LINE.findall(log.read_text())}
        for log in work.glob("tp*-pp*.log")
    }


def check(rows: list[dict], work: Path, pps: list[int]) -> None:
    assert len(rows) == len(pps) * len(PROMPT_LENGTHS) * 2
    groups = kv_cache_groups(work)
    assert len(groups) == 1 + len(pps), groups
    # The target is hybrid to vLLM (a group per attention type, plus the hidden states'), and
    # every arm formed the same groups: one hidden-state group, not one per stage.
    assert {n for seen in groups.values() for n in seen} == {3}, groups
    bad = [r for r in rows if r["max_abs"] != 0.0]
    assert not bad, f"not bitwise identical:\n{report(bad, [])}"


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(3 * 420 + 60)
def test_hybrid_target_pp2_and_pp3_export_is_bitwise_pp1(tmp_path):
    pytest.importorskip("mooncake.store", reason="mooncake (the 'engine' extra) is not importable")
    from hpctoolkit.targets.resolve import resolve_target

    t0 = time.monotonic()
    rows, timings = run_all(str(resolve_target(TARGET)), tmp_path, [2, 3])
    print(f"\n[measure] hybrid PP equivalence ({time.monotonic() - t0:.0f} s)\n{report(rows, timings)}")
    check(rows, tmp_path, [2, 3])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="hybrid target: PP=1 vs PP>1 export equivalence")
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    from hpctoolkit.targets.resolve import resolve_target

    work = Path(a.workdir or tempfile.mkdtemp(prefix="hpctoolkit-pp-hybrid-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, timings = run_all(str(resolve_target(TARGET)), work, a.pp)
    print(report(rows, timings))
    print(kv_cache_groups(work))
    check(rows, work, a.pp)
    print("PASS (bitwise)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
