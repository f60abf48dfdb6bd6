"""Prefill batches (`engine.prefill_batch`): fixed boundaries, the connector's gate, the scheduler
budget that lets one step take a batch, and the recipe's refusals. Pure; no vLLM, milliseconds."""

from __future__ import annotations

import dataclasses

import pytest
from submit_helpers import base, fails

from hpctoolkit.engine.config import BATCH_SCHEDULER_KEYS, EngineConfig
from hpctoolkit.engine.kwargs import CaptureSink, build_llm_kwargs, scheduler_budget
from hpctoolkit.engine.prefill import (
    GROUP_PARAM,
    PrefillGate,
    call_bounds,
    engine_positions,
    prefill_groups,
)
from hpctoolkit.errors import ConfigError, DataIntegrityError

pytestmark = pytest.mark.timeout(60)


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(target_layer_ids=[0, 2, 4], **kw)


# --- fixed batch boundaries -------------------------------------------------------------------


def test_batches_are_cut_at_position_over_batch():
    assert prefill_groups(range(7), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert prefill_groups(range(4), 1) == [[0], [1], [2], [3]]
    assert prefill_groups([], 4) == []


@pytest.mark.parametrize("start", [0, 3, 6, 9])
def test_a_run_resumed_at_a_batch_boundary_gets_the_same_batches(start):
    fresh = prefill_groups(range(12), 3)  # positions 0..11 are their own indices
    left = list(range(start, 12))
    resumed = [[left[i] for i in g] for g in prefill_groups(left, 3)]
    assert resumed == fresh[start // 3 :]


def test_a_batch_split_by_a_checkpoint_keeps_its_other_members_together():
    left = [0, 2, 3, 7, 8, 9, 10]  # positions 1, 4, 5, 6 were trained on
    assert [[left[i] for i in g] for g in prefill_groups(left, 4)] == [[0, 2, 3], [7], [8, 9, 10]]


def test_positions_must_increase():
    with pytest.raises(DataIntegrityError, match="position 2 follows 2"):
        prefill_groups([1, 2, 2], 2)
    with pytest.raises(DataIntegrityError, match="position -1"):
        prefill_groups([-1], 2)
    with pytest.raises(ValueError, match="prefill batch must be >= 1"):
        prefill_groups([0], 0)


def test_calls_hold_whole_batches_at_fixed_positions():
    assert call_bounds(range(10), 4) == [(0, 4), (4, 8), (8, 10)]
    # A resumed attempt: fewer samples per call, the same cuts.
    assert call_bounds([1, 2, 5, 9, 11], 4) == [(0, 2), (2, 3), (3, 5)]


def test_engine_positions_are_places_among_the_engines_own_prompts():
    assert engine_positions(1, 3, [1, 4, 10]) == [0, 1, 3]
    assert engine_positions(0, 1, [0, 5]) == [0, 5]
    with pytest.raises(DataIntegrityError, match="engine 1 of 3 was handed prompt 5"):
        engine_positions(1, 3, [1, 5])


# --- the connector's gate -----------------------------------------------------------------------


def _p(gid: str, size: int) -> dict:
    return {GROUP_PARAM: [gid, size]}


def test_the_gate_admits_a_batch_only_whole_and_in_the_pass_after_it_completed():
    gate = PrefillGate()
    assert not gate.admit("a", _p("b1", 3))  # pass 1: one of three arrived
    gate.end_pass()
    assert not gate.admit("a", _p("b1", 3)) and not gate.admit("b", _p("b1", 3))
    assert not gate.admit("c", _p("b1", 3))  # pass 2 completes it, but admits none of it
    gate.end_pass()
    assert all(gate.admit(r, _p("b1", 3)) for r in "abc")  # pass 3: all three, together
    assert gate.held == 0


def test_a_request_of_no_batch_is_never_held():
    gate = PrefillGate()
    assert gate.admit("x", None) and gate.admit("y", {"other": 1})


def test_a_preempted_request_is_admitted_again_at_once_and_finished_batches_are_forgotten():
    gate = PrefillGate()
    for r in "ab":
        gate.admit(r, _p("b1", 2))
    gate.end_pass()
    assert gate.admit("a", _p("b1", 2)) and gate.admit("b", _p("b1", 2))
    gate.finished("a", _p("b1", 2))
    assert gate.admit("b", _p("b1", 2))  # b recomputed after a preemption
    gate.finished("b", _p("b1", 2))
    assert gate._seen == {} and gate._size == {} and gate._released == set()
    gate.finished("z", None)  # a request of no batch: nothing to forget


def test_a_batch_whose_requests_disagree_on_its_size_fails():
    gate = PrefillGate()
    gate.admit("a", _p("b1", 2))
    with pytest.raises(DataIntegrityError, match="prefill group b1: request b says size 3, not 2"):
        gate.admit("b", _p("b1", 3))


# --- the scheduler budget -----------------------------------------------------------------------


def _kwargs(cfg: EngineConfig) -> dict:
    kwargs, _ = build_llm_kwargs(cfg, "/models/t", [1, 3, 5, 6], CaptureSink("127.0.0.1:1", {}, "run1"))
    return kwargs


def test_one_prompt_per_generate_keeps_the_sections_budget():
    kw = _kwargs(_cfg(max_num_seqs=8, max_num_batched_tokens=256))
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"]) == (8, 256)


@pytest.mark.parametrize(
    ("batch", "seqs", "tokens", "want"),
    [
        (32, 8, 256, (32, 32 * 2048)),  # grown to a whole batch of max_model_len prompts
        (4, 512, 65536, (512, 65536)),  # already large enough: kept
    ],
)
def test_a_prefill_batch_fits_one_scheduler_pass(batch, seqs, tokens, want):
    cfg = _cfg(prefill_batch=batch, capture_batch=batch, max_num_seqs=seqs, max_num_batched_tokens=tokens)
    assert scheduler_budget(cfg) == want
    kw = _kwargs(cfg)
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"]) == want
    # Any batch of prompts the engine accepts (each < max_model_len) fits one pass, with a slot
    # per request to spare.
    assert kw["max_num_batched_tokens"] >= batch * (cfg.max_model_len - 1) + batch


def test_the_generating_engine_keeps_the_sections_budget():
    from hpctoolkit.engine.regenerate import generation_kwargs
    from hpctoolkit.targets.resolve import resolve_target

    cfg = _cfg(prefill_batch=16, capture_batch=16, max_num_seqs=8, max_num_batched_tokens=256)
    kw, _ = generation_kwargs(cfg, resolve_target("builtin:tiny-qwen3"), backend="cpu")
    assert (kw["max_num_seqs"], kw["max_num_batched_tokens"]) == (8, 256)


# --- refusals -----------------------------------------------------------------------------------


def test_capture_calls_hold_whole_prefill_batches():
    with pytest.raises(ConfigError, match=r"^capture_batch must be a multiple of engine.prefill_batch=8"):
        _cfg(prefill_batch=8, capture_batch=12).validate()
    _cfg(prefill_batch=8, capture_batch=24).validate()


@pytest.mark.parametrize("key", sorted(BATCH_SCHEDULER_KEYS))
def test_extra_args_may_not_resplit_a_prefill_batch(key):
    cfg = _cfg(prefill_batch=2, capture_batch=16, extra_args={key: 1})
    with pytest.raises(
        ConfigError, match=rf"^extra_args may not set \['{key}'\] with engine.prefill_batch=2"
    ):
        cfg.validate()
    dataclasses.replace(cfg, prefill_batch=1).validate()  # one prompt per step: nothing to split


def test_the_recipe_refuses_in_one_line(capsys, tmp_path):
    line = fails(capsys, [*base(tmp_path), "engine.prefill_batch=32", "engine.capture_batch=48"])
    assert line.startswith("engine.capture_batch must be a multiple of engine.prefill_batch=32"), line
    line = fails(capsys, [*base(tmp_path), "engine.prefill_batch=2000"])
    assert line.startswith("engine.prefill_batch must be"), line
