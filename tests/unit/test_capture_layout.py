"""Ownership arithmetic against vLLM's own partitioning, enumerated exhaustively."""

from __future__ import annotations

import pytest

from hpctoolkit.capture import (
    capture_ids_for,
    check_layer_layout,
    owned_layers,
    pp_partition,
    pp_range,
    stage_of,
)
from hpctoolkit.errors import ConfigError

vllm_utils = pytest.importorskip(
    "vllm.distributed.utils", reason="the enumeration compares against vLLM itself"
)
get_pp_indices = vllm_utils.get_pp_indices


@pytest.fixture(autouse=True)
def _no_partition_env(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)


def _check_claims(num_layers: int, pp: int) -> None:
    ids = list(range(num_layers + 1))
    claims = {k: [] for k in ids}
    for rank in range(pp):
        assert pp_range(num_layers, rank, pp) == get_pp_indices(num_layers, rank, pp), (num_layers, rank, pp)
        start, end = get_pp_indices(num_layers, rank, pp)
        for k in owned_layers(ids, num_layers, rank, pp):
            claims[k].append(rank)
        # The rule itself, restated against vLLM's range: post-layer semantics.
        for k in ids:
            mine = start < k <= end or (k == 0 and rank == 0)
            assert (k in owned_layers([k], num_layers, rank, pp)) == mine
    for k, owners in claims.items():
        assert len(owners) == 1, f"L={num_layers} pp={pp}: capture id {k} claimed by {owners}"
        assert owners[0] == stage_of(k, num_layers, pp)


def test_every_layer_count_and_pipeline_size():
    for num_layers in range(1, 129):
        for pp in range(1, min(16, num_layers) + 1):
            _check_claims(num_layers, pp)


def test_uneven_61_over_8():
    assert pp_partition(61, 8) == [7, 7, 8, 8, 8, 8, 8, 7]
    assert [get_pp_indices(61, r, 8)[1] - get_pp_indices(61, r, 8)[0] for r in range(8)] == pp_partition(
        61, 8
    )


@pytest.mark.parametrize(
    ("num_layers", "partition"), [(6, "1,2,3"), (12, "5,5,2"), (61, "10,20,31"), (8, "1,1,1,5")]
)
def test_partition_env_agrees_with_vllm(monkeypatch, num_layers, partition):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
    pp = len(partition.split(","))
    assert pp_partition(num_layers, pp) == [int(x) for x in partition.split(",")]
    _check_claims(num_layers, pp)


def test_partition_env_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "3,3")
    with pytest.raises(ConfigError, match="VLLM_PP_LAYER_PARTITION sums to 6"):
        pp_partition(7, 2)
    with pytest.raises(ConfigError, match="has 2 entries but pp_size is 3"):
        pp_partition(6, 3)


def test_id_zero_belongs_to_stage_zero_only():
    for pp in (1, 2, 3):
        assert [0 in owned_layers([0], 6, r, pp) for r in range(pp)] == [True] + [False] * (pp - 1)


@pytest.mark.parametrize(
    ("ids", "why"),
    [
        ([], "empty"),
        ([1, 3, 3, 6], "duplicates"),
        ([3, 1, 6], "not strictly ascending"),
        ([1, 3, 5], "differs from the target's layer count 6"),
        ([1, 3, 7], "differs from the target's layer count 6"),
    ],
)
def test_check_layer_layout_rejects(ids, why):
    with pytest.raises(ConfigError, match=why):
        check_layer_layout(ids, 6)


def test_capture_ids_shift_and_append():
    assert capture_ids_for([0, 2, 4], 6) == [1, 3, 5, 6]
    with pytest.raises(ConfigError, match=r"must lie in \[0, 4\]"):
        capture_ids_for([0, 5], 6)


def test_stage_without_capture_is_named():
    from hpctoolkit.capture import check_every_stage_captures, stages_without_capture

    # 12 layers over 3 stages: [0,4) [4,8) [8,12); ids 1, 2 and the final 12 leave stage 1 idle.
    assert stages_without_capture([1, 2, 12], 12, 3) == [1]
    with pytest.raises(ConfigError, match=r"stage\(s\) \[1\].*stage 1 owns layers \[4, 8\)"):
        check_every_stage_captures([1, 2, 12], 12, 3)
    check_every_stage_captures([1, 5, 12], 12, 3)
    for num_layers in range(2, 40):
        for pp in range(1, min(8, num_layers) + 1):
            ids = list(range(1, num_layers + 1))
            assert stages_without_capture(ids, num_layers, pp) == []
