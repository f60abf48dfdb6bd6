"""The patched vLLM, piece by piece, without starting an engine (the equivalence test does that).

These import the installed vLLM, so they need `make setup` (which applies the patch series).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.real

vllm = pytest.importorskip("vllm", reason="vLLM (the 'engine' extra) is not installed")


@pytest.fixture
def fake_pp(monkeypatch):
    """Pretend to be rank `rank` of a `size`-stage pipeline, as get_local_aux_layer_ids sees it."""
    import vllm.distributed.parallel_state as ps

    def set_rank(rank: int, size: int) -> None:
        group = SimpleNamespace(rank_in_group=rank, world_size=size)
        monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
        monkeypatch.setattr(ps, "get_pp_group", lambda: group)

    return set_rank


@pytest.mark.timeout(120)
def test_local_ids_are_exactly_capture_owned_layers(fake_pp, monkeypatch):
    """The patch's per-stage split and hpctoolkit's owned_layers are the same arithmetic."""
    from vllm.model_executor.models.extract_hidden_states import get_local_aux_layer_ids

    from hpctoolkit.capture import owned_layers
    from hpctoolkit.engine.rows import stage_heads

    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    checked = 0
    for num_layers in (*range(2, 25), 32, 36, 61, 64):
        all_ids = list(range(num_layers + 1))
        id_lists = [all_ids, [num_layers], [1, num_layers], [*all_ids[::3], num_layers]]
        for pp_size in range(1, min(num_layers, 8) + 1):
            for rank in range(pp_size):
                fake_pp(rank, pp_size)
                for ids in id_lists:
                    local, heads = get_local_aux_layer_ids(ids, num_layers)
                    assert local == owned_layers(ids, num_layers, rank, pp_size), (num_layers, pp_size, rank)
                    # One head count on every stage: one cache layer spec, one KV group.
                    assert heads == stage_heads(ids, num_layers, pp_size)
                    checked += 1
    assert checked > 2000


@pytest.mark.timeout(60)
def test_local_ids_honour_vllm_pp_layer_partition(fake_pp, monkeypatch):
    from vllm.model_executor.models.extract_hidden_states import get_local_aux_layer_ids

    from hpctoolkit.capture import owned_layers

    for partition in ("1,5", "4,2", "2,2,2", "1,1,4", "3,1,1,1"):
        monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
        size = partition.count(",") + 1
        for rank in range(size):
            fake_pp(rank, size)
            local, _ = get_local_aux_layer_ids([0, 1, 3, 5, 6], 6)
            assert local == owned_layers([0, 1, 3, 5, 6], 6, rank, size), (partition, rank)


@pytest.mark.timeout(60)
def test_extract_hidden_states_model_supports_pp():
    from vllm.model_executor.models.extract_hidden_states import ExtractHiddenStatesModel
    from vllm.model_executor.models.interfaces import supports_pp

    assert supports_pp(ExtractHiddenStatesModel)
    empty = ExtractHiddenStatesModel.make_empty_intermediate_tensors(None, 8, None, "cpu")  # type: ignore[arg-type]
    assert dict(empty.tensors) == {}, "the drafter must never add anything to the PP pipe"


@pytest.mark.timeout(60)
def test_non_last_rank_sends_no_aux_key_and_leaves_a_cached_output_intact():
    """Under a FULL CUDA graph replay the model returns one cached output object every time.

    Popping the aux keys out of it in place (the first version of the patch) left the second
    replay of a batch shape with no aux states: "got 0 aux hidden states", engine dead.
    """
    import torch
    from vllm.sequence import IntermediateTensors
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    h, r = torch.randn(5, 4), torch.randn(5, 4)
    aux = [torch.full((5, 4), float(i)) for i in range(3)]
    cached = IntermediateTensors(
        {"hidden_states": h, "residual": r, **{f"aux_hidden_states_{i}": a for i, a in enumerate(aux)}}
    )
    for _replay in range(2):
        sent, got = GPUModelRunner._split_local_aux_hidden_states(None, cached)  # type: ignore[arg-type]
        assert set(sent.tensors) == {"hidden_states", "residual"}  # what plain inference sends
        assert sent.tensors["hidden_states"] is h and sent.tensors["residual"] is r
        assert all(g is a for g, a in zip(got, aux, strict=True))  # in slot order, not copied
    assert len(cached.tensors) == 5


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pp", [2, 3])
def test_engine_config_with_extract_hidden_states_and_pp_is_accepted(pp, monkeypatch):
    """Released 0.32.0 raised NotImplementedError (...SupportsPP) right here."""
    from vllm.engine.arg_utils import EngineArgs

    from hpctoolkit.targets.resolve import resolve_target

    args = EngineArgs(
        model=str(resolve_target("builtin:tiny-qwen3")),
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        enforce_eager=True,
        max_model_len=512,
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5, 6]}},
        },
    )
    config = args.create_engine_config()
    assert config.parallel_config.pipeline_parallel_size == pp
    assert config.speculative_config.draft_parallel_config.pipeline_parallel_size == pp
    # The patch targets the V1 runner; the engine pins it, and this is what the pin selects.
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert config.use_v2_model_runner is False


@pytest.mark.timeout(180)
def test_v2_runner_refuses_extract_hidden_states_under_pp(monkeypatch):
    """The refusal is vLLM's own: V2's unsupported-feature list, so CUDA picks V1 by itself."""
    from vllm.engine.arg_utils import EngineArgs

    from hpctoolkit.targets.resolve import resolve_target

    def args(pp: int) -> EngineArgs:
        return EngineArgs(
            model=str(resolve_target("builtin:tiny-qwen3")),
            pipeline_parallel_size=pp,
            distributed_executor_backend="mp",
            enforce_eager=True,
            max_model_len=512,
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5, 6]}},
            },
        )

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    config = args(2).create_engine_config()
    feature = "extract_hidden_states with pipeline parallelism"
    assert feature in config._get_v2_model_runner_unsupported_features()
    assert feature not in args(1).create_engine_config()._get_v2_model_runner_unsupported_features()
    # As on the CUDA build (Triton present): V1 is picked by itself, and an explicit V2 gets
    # vLLM's own error naming the feature.
    import vllm.config.vllm as vllm_config_mod

    monkeypatch.setattr(vllm_config_mod, "HAS_TRITON", True)
    assert config.use_v2_model_runner is False
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(ValueError, match=f"Model Runner V2 does not yet support: {feature}"):
        config._validate_v2_model_runner()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("extract", "max_tokens", "kept"), [(True, 1, False), (True, 5, True), (False, 1, True)]
)
def test_prefill_only_extract_request_gets_no_draft(extract, max_tokens, kept):
    """A max_tokens=1 capture request must not be scheduled for a verify step after its prefill."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds

    req = SimpleNamespace(
        num_output_tokens=0,  # the pending step's token is not processed yet (PP batch queue)
        max_tokens=max_tokens,
        is_prefill_chunk=False,
        spec_token_ids=[],
        is_finished=lambda: False,
    )
    validated = []
    fake = SimpleNamespace(
        extract_hidden_states=extract,
        requests={"r": req},
        structured_output_manager=SimpleNamespace(
            validate_tokens=lambda r, t: validated.append(t) or list(t)
        ),
    )
    Scheduler.update_draft_token_ids(fake, DraftTokenIds(req_ids=["r"], draft_token_ids=[[42]]))  # type: ignore[arg-type]
    assert req.spec_token_ids == ([42] if kept else [])


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("extract", "max_tokens", "taken"), [(True, 1, False), (True, 5, True), (False, 1, True)]
)
def test_prefill_only_extract_batch_skips_the_blocking_draft_rpc(extract, max_tokens, taken):
    """Taking drafts waits for the last PP rank; for prefill-only capture it would serialize the pipe."""
    from vllm.v1.engine.core import EngineCore

    calls = []
    fake = SimpleNamespace(
        check_for_draft_tokens=True,
        async_scheduling=False,
        scheduler=SimpleNamespace(
            extract_hidden_states=extract,
            running=[SimpleNamespace(max_tokens=max_tokens)],
            update_draft_token_ids=lambda d: None,
        ),
        model_executor=SimpleNamespace(take_draft_token_ids=lambda: calls.append(1)),
    )
    EngineCore.post_step(fake, model_executed=True)  # type: ignore[arg-type]
    assert bool(calls) is taken


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("extract", "drafts", "computed", "draftless"),
    [
        (True, {}, [0, 256], True),  # prompt chunks (the last one samples the first token)
        (True, {"a": [7]}, [0, 256], False),  # a draft to verify
        (True, {}, [0, 300], False),  # request b decodes (its 300-token prompt is computed)
        (False, {}, [0, 256], False),  # another speculative method
    ],
)
def test_draftless_extract_prefill_samples_like_a_plain_batch(extract, drafts, computed, draftless):
    """Such a step takes the plain sampling path: no spec-decode metadata, no rejection sampler."""
    import numpy as np
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fake = SimpleNamespace(
        speculative_config=SimpleNamespace(uses_extract_hidden_states=lambda: extract),
        input_batch=SimpleNamespace(
            num_computed_tokens_cpu=np.array([*computed, 0]),  # the third row is not in the batch
            num_prompt_tokens=np.array([1024, 300, 5]),
        ),
    )
    out = SimpleNamespace(scheduled_spec_decode_tokens=drafts)
    assert GPUModelRunner._is_draftless_extract_prefill(fake, out, 2) is draftless  # type: ignore[arg-type]
