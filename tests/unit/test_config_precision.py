"""`auto` precisions (`config/precision.py`): decided by the host's CUDA and CPU bf16 support."""

import pytest

from hpctoolkit.config.precision import HostFacts, engine_dtype, host_facts
from hpctoolkit.errors import ConfigError
from hpctoolkit.recipe.load import compose, load_recipe, resolve_precision

AVX2 = frozenset({"avx2", "fma"})
SAPPHIRE = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})


@pytest.mark.parametrize(
    ("facts", "device", "engine", "training"),
    [
        (HostFacts(False, AVX2), "cpu", "float32", "fp32"),
        (HostFacts(False, SAPPHIRE), "cpu", "bfloat16", "bf16"),
        (HostFacts(False, frozenset({"avx512_bf16"})), "cpu", "bfloat16", "bf16"),
        (HostFacts(True, AVX2), "cuda", "bfloat16", "bf16"),
        # An engine where CUDA is visible; a CPU trainer beside it still follows the CPU.
        (HostFacts(True, AVX2), "cpu", "bfloat16", "fp32"),
    ],
)
def test_auto_follows_the_hardware(facts, device, engine, training):
    cfg = compose("recipes/local.yaml", [f"training.device={device}"])
    got = resolve_precision(cfg, facts)
    assert (got.engine.dtype, got.training.mixed_precision) == (engine, training)
    assert cfg.engine.dtype == "auto" and cfg.training.mixed_precision == "auto"  # not changed


def test_a_named_precision_is_kept_whatever_the_host():
    cfg = compose("recipes/local.yaml", ["engine.dtype=bfloat16", "training.mixed_precision=bf16"])
    assert resolve_precision(cfg, HostFacts(False, AVX2)) is cfg


def test_engine_dtype_decides_auto_and_keeps_a_name():
    assert engine_dtype("auto", HostFacts(False, AVX2)) == "float32"
    assert engine_dtype("auto", HostFacts(False, SAPPHIRE)) == "bfloat16"
    assert engine_dtype("auto", HostFacts(True, AVX2)) == "bfloat16"
    assert engine_dtype("float16", HostFacts(False, AVX2)) == "float16"


def test_host_facts_read_the_cpu_flags_and_the_driver_s_gpus(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert host_facts(info).cpu_bf16
    assert not host_facts(tmp_path / "absent").cpu_bf16
    gpus = tmp_path / "gpus"
    assert not host_facts(info, gpus).cuda
    (gpus / "0000:18:00.0").mkdir(parents=True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert host_facts(info, gpus).cuda
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not host_facts(info, gpus).cuda


def test_load_resolves_auto_and_refuses_an_unknown_precision():
    cfg = load_recipe("recipes/local.yaml")
    assert cfg.engine.dtype in ("bfloat16", "float32") and cfg.training.mixed_precision in ("bf16", "fp32")
    with pytest.raises(ConfigError, match=r"engine\.dtype"):
        load_recipe("recipes/local.yaml", ["engine.dtype=bf16"])
