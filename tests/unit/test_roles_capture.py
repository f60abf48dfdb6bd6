"""The engine leader's capture loop (`roles.engines._capture`) around a stand-in engine: its calls
and their positions are cut at fixed engine-local positions, a fresh and a resumed attempt alike."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from hpctoolkit.capture import build_manifest
from hpctoolkit.engine.config import EngineConfig
from hpctoolkit.roles import engines
from hpctoolkit.rundir import ledger

pytestmark = pytest.mark.timeout(60)


class _Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[list[list[int]], list[int]]] = []

    def capture(self, prompts, positions):
        self.calls.append((list(prompts), list(positions)))
        return [
            build_manifest(
                sample_key=f"k{p}", capture_ids=[1, 2], num_tokens=len(ids), hidden_size=4, num_layers=2,
                pp_size=1, dtype="bfloat16",
            )
            for ids, p in zip(prompts, positions, strict=True)
        ]  # fmt: skip


class _Queue:
    run_prefix = "run-e1"

    def __init__(self) -> None:
        self.lines: list[str] = []

    @property
    def published(self) -> int:
        return len(self.lines)

    def append(self, line: str) -> None:
        self.lines.append(line)


def _run(monkeypatch, indices: list[int], *, num_engines: int, engine: int, prefill: int, per_call: int):
    gate = SimpleNamespace(wait=lambda stop: None, published=lambda m: None)
    monkeypatch.setattr(engines.backpressure, "for_engine", lambda *a, **k: gate)
    monkeypatch.setattr(engines, "_trainers_preempted", lambda ctx: False)
    cfg = SimpleNamespace(
        engine=EngineConfig(num_engines=num_engines, prefill_batch=prefill, capture_batch=per_call)
    )
    eng, queue = _Engine(), _Queue()
    todo = [(i, f"key{i}", [5] * (i + 1)) for i in indices]
    masks = SimpleNamespace(publish=lambda m: m)
    engines._capture(
        SimpleNamespace(cfg=cfg), engine, eng, queue, masks, todo, threading.Event(), threading.Event()
    )  # type: ignore[arg-type]
    return eng.calls, queue


def test_calls_are_cut_at_fixed_positions_of_the_engines_own_prompts(monkeypatch):
    # Engine 1 of 2 owns prompts 1, 3, 5, ...: positions 0, 1, 2, ...
    calls, queue = _run(monkeypatch, list(range(1, 20, 2)), num_engines=2, engine=1, prefill=2, per_call=4)
    assert [pos for _, pos in calls] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert calls[0][0][1] == [5] * 4  # prompt 3's ids
    last = json.loads(queue.lines[-1])
    assert len(queue.lines) == 10 and last["extra"][ledger.PROMPT_KEY] == 19
    assert last["extra"][ledger.CONTENT_KEY] == "key19"


def test_a_resumed_attempt_keeps_the_cuts_of_a_fresh_one(monkeypatch):
    # Prompts 3, 9 and 11 (positions 1, 4, 5) were trained on by the checkpoint.
    left = [1, 5, 7, 13, 15, 17, 19]
    calls, _ = _run(monkeypatch, left, num_engines=2, engine=1, prefill=2, per_call=4)
    assert [pos for _, pos in calls] == [[0, 2, 3], [6, 7], [8, 9]]
