"""The PP preflight gates: K3 AttnRes boundary arithmetic, layout against vLLM, per-stage capture.

The boundary and layout tests are pure and exhaustive. The per-stage capture tests import model
classes through vLLM's registry (code only, no weights); they skip where vLLM is not installed.
"""

from __future__ import annotations

import inspect
import os
import types

import pytest

from hpctoolkit.capture import pp_range
from hpctoolkit.engine import env as engine_env_mod
from hpctoolkit.engine.config import EngineConfig
from hpctoolkit.engine.pp_gates import (
    CAPABILITY,
    K3_STREAM_ENV,
    check_k3_attnres_boundary,
    check_layout_against_vllm,
    check_per_stage_capture,
    decoder_classes,
    k3_attnres_boundary_violations,
    k3_attnres_stream_active,
    preflight,
    preflight_vllm_config,
    resolve_model_class,
)
from hpctoolkit.errors import ConfigError

# Kimi-K3's decoder layer count as vLLM 0.32 knows it: `vllm/transformers_utils/configs/kimi_k3.py`
# `KimiK3Config.__init__` builds `text_config = KimiLinearConfig()` when none is given, and
# `KimiLinearConfig` (`configs/kimi_linear.py`) defaults `num_hidden_layers=32`. vLLM ships no other
# K3 layer count; `test_k3_layer_count_is_vllms` pins this one against the installed config class.
K3_NUM_LAYERS = 32

# Capture ids that end a non-last stage of the 32 layers, by vLLM's split (remainder to the stages
# before the last, walking backwards), written out by hand:
#   pp=3 [11,11,10]  pp=5 [6,6,7,7,6]  pp=6 [5,5,5,6,6,5]  pp=7 [4,4,5,5,5,5,4]
K3_REJECTED = {
    2: [16],
    3: [11, 22],
    4: [8, 16, 24],
    5: [6, 12, 19, 26],
    6: [5, 10, 15, 21, 27],
    7: [4, 8, 13, 18, 23, 28],
    8: [4, 8, 12, 16, 20, 24, 28],
}


@pytest.fixture(autouse=True)
def _no_partition_env(monkeypatch):
    monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
    monkeypatch.delenv(K3_STREAM_ENV, raising=False)


@pytest.fixture
def vllm_registry():
    return pytest.importorskip(
        "vllm.model_executor.models.registry", reason="the gate resolves classes through vLLM's registry"
    )


# ------------------------------------------------------------------ Kimi-K3 AttnRes boundary


def test_k3_layer_count_is_vllms():
    configs = pytest.importorskip(
        "vllm.transformers_utils.configs.kimi_k3", reason="the K3 layer count is read from vLLM's config"
    )
    assert configs.KimiK3Config().text_config.num_hidden_layers == K3_NUM_LAYERS


def test_k3_boundary_semantics_are_the_ones_read():
    """Pin the lines of vLLM's K3 model the rule was derived from; a change there must be re-read."""
    model = pytest.importorskip("vllm.models.kimi_k3.nvidia.model", reason="the K3 model is vLLM's")
    src = inspect.getsource(model.KimiLinearModel._capture_aux_hidden_stream)
    assert "if not (self._aux_attn_res_stream and self.use_attn_res):" in src
    assert "if layer_idx + 1 < self.end_layer:" in src
    assert "elif get_pp_group().is_last_rank:" in src
    assert "crossed a PP boundary" in src
    setter = inspect.getsource(model.KimiLinearModel._set_aux_hidden_state_layers)
    assert "not pp.is_last_rank and self.end_layer in self.aux_hidden_state_layers" in setter
    fwd = inspect.getsource(model.KimiLinearModel.forward)
    assert "if (layer_idx + 1) in self.aux_hidden_state_layers:" in fwd


@pytest.mark.parametrize("pp", sorted(K3_REJECTED))
def test_k3_rejects_exactly_the_non_last_stage_ends(pp):
    ids = list(range(K3_NUM_LAYERS + 1))
    assert k3_attnres_boundary_violations(ids, K3_NUM_LAYERS, pp) == K3_REJECTED[pp]
    for k in ids:
        expect = [k] if k in K3_REJECTED[pp] else []
        assert k3_attnres_boundary_violations([k], K3_NUM_LAYERS, pp) == expect, (pp, k)
    # The hand-written table is vLLM's own split.
    ends = [pp_range(K3_NUM_LAYERS, r, pp)[1] for r in range(pp - 1)]
    assert ends == K3_REJECTED[pp]


@pytest.mark.parametrize("pp", sorted(K3_REJECTED))
def test_k3_table_against_vllm_get_pp_indices(pp):
    utils = pytest.importorskip("vllm.distributed.utils", reason="compares against vLLM's partition")
    assert [utils.get_pp_indices(K3_NUM_LAYERS, r, pp)[1] for r in range(pp - 1)] == K3_REJECTED[pp]


@pytest.mark.parametrize("pp", sorted(K3_REJECTED))
def test_k3_check_message_names_ids_layers_and_split(pp):
    bad = K3_REJECTED[pp][0]
    ids = [1, bad, K3_NUM_LAYERS] if bad != 1 else [bad, K3_NUM_LAYERS]
    with pytest.raises(ConfigError) as exc:
        check_k3_attnres_boundary(ids, K3_NUM_LAYERS, pp)
    msg = str(exc.value)
    assert f"capture ids [{bad}]" in msg
    assert f"target_layer_ids [{bad - 1}]" in msg
    assert f"pp_size={pp}" in msg and K3_STREAM_ENV in msg and "VLLM_PP_LAYER_PARTITION" in msg
    safe = [k for k in range(K3_NUM_LAYERS + 1) if k not in K3_REJECTED[pp]]
    check_k3_attnres_boundary(safe, K3_NUM_LAYERS, pp)


def test_k3_embeddings_final_layer_and_pp1_are_never_rejected():
    for pp in range(1, 9):
        assert k3_attnres_boundary_violations([0, K3_NUM_LAYERS], K3_NUM_LAYERS, pp) == []
    assert k3_attnres_boundary_violations(range(K3_NUM_LAYERS + 1), K3_NUM_LAYERS, 1) == []


@pytest.mark.parametrize("num_layers", range(2, 65))
def test_boundary_rule_every_layer_count(num_layers):
    """Any layer count: exactly one rejected id per non-last stage, its end; never 0 or L."""
    for pp in range(2, min(8, num_layers) + 1):
        bad = k3_attnres_boundary_violations(range(num_layers + 1), num_layers, pp)
        assert bad == [pp_range(num_layers, r, pp)[1] for r in range(pp - 1)]
        assert len(bad) == pp - 1 and 0 not in bad and num_layers not in bad


def test_partition_override_moves_the_boundary(monkeypatch):
    assert k3_attnres_boundary_violations([10, 16], K3_NUM_LAYERS, 2, partition=[10, 22]) == [10]
    assert k3_attnres_boundary_violations([10, 16], K3_NUM_LAYERS, 2, partition="10,22") == [10]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "20,12")
    assert k3_attnres_boundary_violations([16, 20], K3_NUM_LAYERS, 2) == [20]


@pytest.mark.parametrize(
    ("raw", "block", "active"),
    [(None, 4, False), ("0", 4, False), ("1", 4, True), ("2", 4, True), ("1", None, False)],
)
def test_k3_stream_active_parses_like_vllm(raw, block, active):
    env = {} if raw is None else {K3_STREAM_ENV: raw}
    cfg = types.SimpleNamespace(attn_res_block_size=block)
    assert k3_attnres_stream_active(cfg, env) is active


def test_k3_stream_flag_not_an_integer():
    with pytest.raises(ConfigError, match=K3_STREAM_ENV):
        k3_attnres_stream_active(types.SimpleNamespace(attn_res_block_size=4), {K3_STREAM_ENV: "yes"})


# ------------------------------------------------------------------ layout against vLLM


def _fake_model_config(num_layers: int, arch: str = "Qwen3ForCausalLM", attn_res_block_size=None):
    """The `ModelConfig` surface the gates read (and the fields the registry consults)."""
    return types.SimpleNamespace(
        architectures=[arch],
        hf_text_config=types.SimpleNamespace(attn_res_block_size=attn_res_block_size, architectures=[arch]),
        get_total_num_hidden_layers=lambda: num_layers,
        model_impl="auto",
        runner_type="generate",
        convert_type="none",
        hf_config=types.SimpleNamespace(auto_map={}),
    )


def test_layout_against_vllm_count():
    mc = _fake_model_config(6)
    check_layout_against_vllm(mc, [1, 3, 5, 6])
    check_layout_against_vllm(mc, [6])
    with pytest.raises(ConfigError, match="final capture id 5 differs"):
        check_layout_against_vllm(mc, [1, 3, 5])
    with pytest.raises(ConfigError, match="not strictly ascending"):
        check_layout_against_vllm(mc, [3, 1, 6])
    with pytest.raises(ConfigError, match="empty"):
        check_layout_against_vllm(mc, [])


def test_layout_reads_vllms_own_model_config(tmp_path):
    model_mod = pytest.importorskip("vllm.config", reason="reads vLLM's ModelConfig")
    from hpctoolkit.targets.builtin import build

    model_dir = build("tiny-qwen3", tmp_path / "tiny")
    mc = model_mod.ModelConfig(model=str(model_dir), dtype="bfloat16", max_model_len=128)
    assert mc.get_total_num_hidden_layers() == 6
    check_layout_against_vllm(mc, [1, 3, 5, 6])
    with pytest.raises(ConfigError, match="layer count 6"):
        check_layout_against_vllm(mc, [1, 3, 7])


# ------------------------------------------------------------------ per-stage capture


def test_pp1_needs_no_capability():
    check_per_stage_capture(["NotARealArchitecture"], 1)


@pytest.mark.parametrize(
    "arch",
    [
        "Qwen3ForCausalLM",
        "Qwen2ForCausalLM",
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "KimiLinearForCausalLM",
        "KimiK3ForConditionalGeneration",  # wraps KimiLinearForCausalLM via init_vllm_registered_model
    ],
)
def test_per_stage_capture_accepted(vllm_registry, arch):
    check_per_stage_capture([arch], 2)


@pytest.mark.parametrize(
    ("arch", "why"),
    [
        ("Qwen3MoeForCausalLM", "['Qwen3MoeModel'] that do not set supports_aux_hidden_states_over_pp"),
        ("MiMoForCausalLM", "['MiMoModel'] that do not set"),  # subclass of Qwen2 with its own decoder
        ("DeepseekV3ForCausalLM", "no decoder that mixes in vLLM's EagleModelMixin"),
        ("GPT2LMHeadModel", "does not implement SupportsEagle3"),
    ],
)
def test_per_stage_capture_rejected_naming_the_architecture(vllm_registry, arch, why):
    with pytest.raises(ConfigError) as exc:
        check_per_stage_capture([arch], 2)
    msg = str(exc.value)
    assert arch in msg and why in msg and "engine.pp_size=2" in msg and "engine.pp_size=1" in msg


def test_unregistered_architecture(vllm_registry):
    with pytest.raises(ConfigError, match=r"\['NotARealArchitecture'\] are not in vLLM's model registry"):
        check_per_stage_capture(["NotARealArchitecture"], 2)
    with pytest.raises(ConfigError, match="no 'architectures'"):
        resolve_model_class([])


@pytest.mark.parametrize(
    "arch",
    [
        "Qwen3ForCausalLM",
        "LlamaForCausalLM",
        "KimiLinearForCausalLM",
        "Qwen3MoeForCausalLM",
        "MiMoForCausalLM",
    ],
)
def test_capability_means_non_last_stages_pack_their_aux_states(vllm_registry, arch):
    """What the flag implies, checked on the decoders the gate finds: it is set exactly on the
    decoders whose forward returns its local aux states from a non-last stage."""
    cls, _ = resolve_model_class([arch])
    decoders, _ = decoder_classes(cls)
    assert decoders
    for dec in decoders:
        packs = "pack_local_aux_hidden_states" in inspect.getsource(dec.forward)
        assert getattr(dec, CAPABILITY) is packs, dec.__qualname__


def test_decoder_discovery_reads_methods_class_attributes_and_arch_names(vllm_registry):
    from vllm.model_executor.models.interfaces import EagleModelMixin

    ns: dict = {"EagleModelMixin": EagleModelMixin, "__name__": "fake_model_module"}
    exec(  # functions defined here get `ns` as their globals, as a model module's would
        "class Good(EagleModelMixin):\n"
        "    supports_aux_hidden_states_over_pp = True\n"
        "class Bad(EagleModelMixin):\n"
        "    pass\n"
        "class Unrelated:\n"
        "    pass\n"
        "class ByGlobal:\n"
        "    def __init__(self):\n"
        "        self.model = Good()\n"
        "        self.other = Unrelated()\n"
        "class ByLambda:\n"
        "    def _init(self):\n"
        "        return [(lambda: Bad())() for _ in range(1)]\n"
        "class ByAttr:\n"
        "    model_cls = Good\n"
        "    def __init__(self):\n"
        "        self.model = self.model_cls()\n"
        "class ByAttrOverride(ByAttr):\n"
        "    model_cls = Bad\n"
        "class Wrapper:\n"
        "    def __init__(self):\n"
        "        self.language_model = build(architectures=['LlamaForCausalLM'])\n",
        ns,
    )
    assert decoder_classes(ns["ByGlobal"]) == ({ns["Good"]}, set())
    assert decoder_classes(ns["ByLambda"]) == ({ns["Bad"]}, set())
    assert decoder_classes(ns["ByAttr"]) == ({ns["Good"]}, set())
    assert decoder_classes(ns["ByAttrOverride"]) == ({ns["Bad"]}, set())  # the effective attribute
    assert decoder_classes(ns["Wrapper"]) == (set(), {"LlamaForCausalLM"})


# ------------------------------------------------------------------ preflight


def _pp2(target_layer_ids=(0, 2, 4)) -> EngineConfig:
    cfg = EngineConfig(target_layer_ids=list(target_layer_ids), gpus_per_node=2, pp_size=2)
    cfg.validate()
    return cfg


def test_preflight_k3_boundary_only_with_flag_and_attnres(vllm_registry, tmp_path):
    k3 = _fake_model_config(K3_NUM_LAYERS, "KimiK3ForConditionalGeneration", attn_res_block_size=4)
    ids = [3, 16, K3_NUM_LAYERS]
    with pytest.raises(ConfigError, match=r"capture ids \[16\]"):
        preflight(_pp2(), tmp_path, ids, model_config=k3, env={K3_STREAM_ENV: "1"})
    # The engine's environment decides, including its partition.
    preflight(
        _pp2(), tmp_path, ids, model_config=k3, env={K3_STREAM_ENV: "1", "VLLM_PP_LAYER_PARTITION": "15,17"}
    )
    preflight(_pp2(), tmp_path, ids, model_config=k3, env={K3_STREAM_ENV: "0"})
    no_attnres = _fake_model_config(K3_NUM_LAYERS, "KimiK3ForConditionalGeneration")
    preflight(_pp2(), tmp_path, ids, model_config=no_attnres, env={K3_STREAM_ENV: "1"})
    pp1 = EngineConfig(target_layer_ids=[0], pp_size=1)
    preflight(pp1, tmp_path, ids, model_config=k3, env={K3_STREAM_ENV: "1"})


def test_preflight_rejects_incapable_target_and_bad_layout(vllm_registry, tmp_path):
    with pytest.raises(ConfigError, match="Qwen3MoeForCausalLM"):
        preflight(_pp2(), tmp_path, [1, 3, 5, 6], model_config=_fake_model_config(6, "Qwen3MoeForCausalLM"))
    with pytest.raises(ConfigError, match="layer count 6"):
        preflight(_pp2(), tmp_path, [1, 3, 5], model_config=_fake_model_config(6))


def test_preflight_on_a_real_target(vllm_registry, tmp_path):
    from hpctoolkit.targets.builtin import build

    model_dir = build("tiny-qwen3", tmp_path / "tiny")
    mc = preflight(_pp2(), model_dir, [1, 3, 5, 6])
    assert mc.architectures == ["Qwen3ForCausalLM"]
    with pytest.raises(ConfigError, match="does not exist"):
        preflight(_pp2(), tmp_path / "missing", [1, 3, 5, 6])


def test_preflight_from_a_built_vllm_config(vllm_registry):
    """What a headless follower runs: the same gates, read off its `VllmConfig`."""
    k3 = _fake_model_config(K3_NUM_LAYERS, "KimiK3ForConditionalGeneration", attn_res_block_size=4)

    def vllm_config(method: str, ids: list[int]):
        hf = types.SimpleNamespace(eagle_aux_hidden_state_layer_ids=ids)
        spec = types.SimpleNamespace(method=method, draft_model_config=types.SimpleNamespace(hf_config=hf))
        return types.SimpleNamespace(
            speculative_config=spec,
            model_config=k3,
            parallel_config=types.SimpleNamespace(pipeline_parallel_size=2),
        )

    with pytest.raises(ConfigError, match=r"capture ids \[16\]"):
        preflight_vllm_config(vllm_config("extract_hidden_states", [3, 16, 32]), {K3_STREAM_ENV: "1"})
    with pytest.raises(ConfigError, match="final capture id 31"):
        preflight_vllm_config(vllm_config("extract_hidden_states", [3, 31]), {})
    preflight_vllm_config(vllm_config("extract_hidden_states", [3, 17, 32]), {K3_STREAM_ENV: "1"})
    preflight_vllm_config(vllm_config("eagle3", [3, 16, 32]), {K3_STREAM_ENV: "1"})  # not a capture engine
    preflight_vllm_config(types.SimpleNamespace(speculative_config=None))


def _write_moe_target(transformers, directory) -> None:
    """config.json of a tiny Qwen3-MoE target (no weights): a decoder without per-stage capture."""
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.to_json_file(str(directory / "config.json"))


def test_preflight_rejects_a_real_moe_target_from_its_config_alone(vllm_registry, tmp_path):
    """A Qwen3-MoE target (decoder without the capability) with no weights on disk at all: the gate
    needs only config.json. Measured without the gate on this patch series (vLLM-CPU, PP=2, eager):
    the engine loads and starts (~80 s), then the first request kills it with EngineDeadError after
    the stage-0 worker finds 0 aux states for its capture ids."""
    transformers = pytest.importorskip("transformers")
    _write_moe_target(transformers, tmp_path)
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM .* builds decoder\(s\) \['Qwen3MoeModel'\]"):
        preflight(_pp2(), tmp_path, [1, 3, 5, 6])
    assert not list(tmp_path.glob("*.safetensors"))
    preflight(EngineConfig(target_layer_ids=[0, 2, 4]), tmp_path, [1, 3, 5, 6])  # PP=1 needs no capability


def test_capture_engine_refuses_an_incapable_target_before_building_vllm(
    vllm_registry, tmp_path, monkeypatch
):
    """`CaptureEngine` runs the gates itself: a PP=2 Qwen3-MoE target is refused before `vllm.LLM`."""
    transformers = pytest.importorskip("transformers")
    import vllm

    from hpctoolkit.engine.engine import CaptureEngine

    _write_moe_target(transformers, tmp_path)
    built = []
    monkeypatch.setattr(vllm, "LLM", lambda **kw: built.append(kw))
    monkeypatch.setenv("HPCTOOLKIT_ENGINE_BACKEND", "cpu")
    for name in engine_env_mod.ENGINE_ENV_KEYS:
        # CaptureEngine sets them in os.environ; setenv records the old value (or its absence).
        monkeypatch.setenv(name, os.environ.get(name, ""))
    # A fault record an earlier run left in the shared fault directory is cleared, the folder kept.
    faults = tmp_path / "out" / "faults" / "engine1"
    faults.mkdir(parents=True)
    (faults / "fault-1-1.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"Qwen3MoeForCausalLM .* builds decoder\(s\) \['Qwen3MoeModel'\]"):
        CaptureEngine(_pp2(), tmp_path, None, None, "gate-test", engine_index=1, fault_dir=faults)
    assert built == []
    assert faults.is_dir() and not list(faults.iterdir())
