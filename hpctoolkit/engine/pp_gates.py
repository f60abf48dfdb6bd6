"""Fail-closed gates that run before a capture engine loads weights.

Each gate turns a configuration that would otherwise fail late and obscurely, or silently export
features that depend on the pipeline partition, into a `ConfigError` at engine start. `preflight`
runs all of them; the engine calls it before it constructs `vllm.LLM` (or a headless follower).

Per-stage capture (`check_per_stage_capture`)
    With `pp_size > 1` every stage must capture the aux layers it owns. The capability read is
    vLLM's own `EagleModelMixin.supports_aux_hidden_states_over_pp` (vllm 0.32
    `model_executor/models/interfaces.py`), on the decoder class that the registered model class
    builds. A decoder that sets it collects `hidden + residual` for its *local* layers on every rank
    and, on a non-last rank, returns them next to `hidden_states`/`residual` in its
    `IntermediateTensors` (`pack_local_aux_hidden_states`; Qwen2/Qwen3 `qwen2.py` forward, Llama
    `llama.py` forward, Kimi `KimiLinearModel.forward`). It is the flag vLLM's V2 runner itself checks
    before allowing Eagle3 capture with PP (`verify_supports_aux_hidden_states_over_pp` in
    `v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`), and in 0.32 the decoders that set it are
    exactly the ones whose forward calls `pack_local_aux_hidden_states` (qwen2, llama, sarvam,
    deepseek_v4, minimax_m3, kimi_k3). Our PP patch keeps those `aux_hidden_states_*` keys out of
    what each non-last rank sends and caches them there (`_split_local_aux_hidden_states`).
    Neither `SupportsPP` nor `SupportsEagle3` on the top-level class implies it: a mixin decoder without the flag (e.g. `Qwen3MoeModel`, or
    `MiMoModel`, which sets it to False explicitly) drops its aux list on non-last ranks, and
    `DeepseekV2Model` keeps its own aux list outside the mixin; either way the non-last rank has
    nothing to export and the run dies in `_dummy_run` with `too many values to unpack`.

    The registry resolves `architectures` to the model class by importing its module only (no
    weights, no device). The decoder class is not a class attribute in vLLM; it is whatever the
    class's own methods construct (`self.model = Qwen3Model(...)`, `LlamaForCausalLM._init_model`,
    or a `model_cls` class attribute as in DeepseekV4). `decoder_classes` therefore reads the
    globals those methods name and the class attributes, keeps the `EagleModelMixin` subclasses
    among them, and follows registered architecture names the methods
    mention (wrappers such as `KimiK3ForConditionalGeneration` build their language model through
    `init_vllm_registered_model(architectures=["KimiLinearForCausalLM"])`). The gate passes only if
    at least one decoder is found and every decoder found sets the flag, so an unresolvable or mixed
    case is rejected, never admitted.

Layer layout (`check_layout_against_vllm`)
    The final capture id must equal vLLM's `ModelConfig.get_total_num_hidden_layers()` and the ids
    must ascend; `hpctoolkit.capture.check_layer_layout` does the arithmetic.

Kimi-K3 AttnRes boundary (`check_k3_attnres_boundary`)
    Read from vllm 0.32 `vllm/models/kimi_k3/nvidia/model.py`, `KimiLinearModel` (our patch series
    does not touch that file). Capture id `k` is taken after layer `k - 1` ran (`forward`, line
    1352: `if (layer_idx + 1) in self.aux_hidden_state_layers`). `_capture_aux_hidden_stream`
    (line 1246) returns the raw running prefix (`prefix_sum + pending_mlp_out`) unless both
    `VLLM_KIMI_K3_AUX_ATTN_RES_STREAM` is set and the target uses AttnRes (`attn_res_block_size`
    is not None). With both, it returns the AttnRes mixture that the *consumer* of that state reads:

    * `k < end_layer` of the owning stage (line 1258): the mixture with layer `k`'s
      `self_attention_res_norm` / `self_attention_res_proj` over its `prev_valid_blocks =
      ceil(k / attn_res_block_size)` blocks (line 977);
    * `k == end_layer` of the last stage, i.e. `k == L`: the mixture with `output_attn_res_norm` /
      `output_attn_res_proj`;
    * `k == end_layer` of a non-last stage: layer `k` lives on the next stage, so this rank builds
      no consumer weights. Stock 0.32 raises (`_set_aux_hidden_state_layers`, line 1224: "cannot
      end a non-final PP stage"; `_capture_aux_hidden_stream`, line 1268: "crossed a PP
      boundary"). Our patch series hands each rank its local ids from `load_model`, so that
      ValueError comes only after the weights loaded, from a worker; the specification's patch
      instead fell back to the raw prefix, so the feature silently differed from the PP=1 mixture
      for the same id (the Codex review comment).
    * id 0 (the embeddings, first rank, line 1322) is appended unmixed at every `pp_size`.

    So the ids rejected are exactly the ends of the non-last stages,
    `{sum(partition[:r + 1]) for r < pp_size - 1}`, whenever the flag and AttnRes are both on;
    rejecting them is simpler than computing the tap on the next stage, which would need the
    pre-mixture prefix and block residuals to cross the pipe.
"""

from __future__ import annotations

import inspect
import os
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpctoolkit.capture import check_every_stage_captures, check_layer_layout, pp_partition
from hpctoolkit.capture.layout import PARTITION_ENV
from hpctoolkit.errors import ConfigError

if TYPE_CHECKING:
    from vllm.config import ModelConfig

    from hpctoolkit.engine.config import EngineConfig

CAPABILITY = "supports_aux_hidden_states_over_pp"
K3_STREAM_ENV = "VLLM_KIMI_K3_AUX_ATTN_RES_STREAM"
# Modules whose classes are interfaces or framework bases, not model code that builds a decoder.
_SKIP_MODULE_PREFIXES = ("builtins", "typing", "abc", "torch.", "vllm.model_executor.models.interfaces")


# --- per-stage capture -------------------------------------------------------------------------


def _code_objects(fn: types.FunctionType) -> Iterator[types.CodeType]:
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        yield code
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))


def decoder_classes(model_cls: type) -> tuple[set[type], set[str]]:
    """The `EagleModelMixin` decoder classes `model_cls`'s methods name, and registered arch names.

    Only the class and its bases' own functions are read (their code objects, nested lambdas and
    comprehensions included); nothing is instantiated.
    """
    from vllm.model_executor.models.interfaces import EagleModelMixin
    from vllm.model_executor.models.registry import ModelRegistry

    registered = ModelRegistry.get_supported_archs()
    decoders: set[type] = set()
    archs: set[str] = set()
    own = [k for k in model_cls.__mro__ if not k.__module__.startswith(_SKIP_MODULE_PREFIXES)]
    # A decoder held as a class attribute and built as `self.model_cls(...)` (DeepseekV4): the
    # effective attribute, so a subclass's override replaces its base's.
    for name in {n for klass in own for n in vars(klass)}:
        attr = inspect.getattr_static(model_cls, name)
        if isinstance(attr, type) and issubclass(attr, EagleModelMixin):
            decoders.add(attr)
    for klass in own:
        for attr in vars(klass).values():
            fn = attr.__func__ if isinstance(attr, classmethod | staticmethod) else attr
            if not inspect.isfunction(fn):
                continue
            for code in _code_objects(fn):
                for name in code.co_names:
                    obj = fn.__globals__.get(name)
                    if isinstance(obj, type) and issubclass(obj, EagleModelMixin):
                        decoders.add(obj)
                archs.update(c for c in code.co_consts if isinstance(c, str) and c in registered)
    archs.discard(model_cls.__name__)
    return decoders, archs


class _RegistryQuery:
    """The few `ModelConfig` fields `ModelRegistry.resolve_model_cls` reads, for a bare arch list.

    `model_impl="vllm"` keeps the registry from substituting the Transformers backend.
    """

    model_impl = "vllm"
    runner_type = "generate"
    convert_type = "none"
    hf_config = types.SimpleNamespace(auto_map={})


def resolve_model_class(architectures: Sequence[str], model_config: Any = None) -> tuple[type, str]:
    """vLLM's model class for `architectures`, through its registry (imports code, loads no weights)."""
    from vllm.model_executor.models.registry import ModelRegistry

    if not architectures:
        raise ConfigError("the target config lists no 'architectures'; vLLM cannot resolve a model class")
    known = ModelRegistry.get_supported_archs()
    if model_config is None and not any(a in known for a in architectures):
        raise ConfigError(
            f"target architectures {list(architectures)} are not in vLLM's model registry "
            f"({len(known)} known; see vllm.ModelRegistry.get_supported_archs())"
        )
    try:
        return ModelRegistry.resolve_model_cls(list(architectures), model_config or _RegistryQuery())
    except ValueError as err:
        raise ConfigError(f"vLLM cannot resolve target architectures {list(architectures)}: {err}") from err


def per_stage_capture_problem(architectures: Sequence[str], model_config: Any = None) -> str | None:
    """Why the target cannot capture aux states on every pipeline stage, or None if it can."""
    from vllm.model_executor.models.interfaces import supports_eagle3, supports_pp

    cls, arch = resolve_model_class(architectures, model_config)
    where = f"{arch} ({cls.__module__}.{cls.__qualname__})"
    if not supports_pp(cls):
        return f"{where} does not implement SupportsPP"
    if not supports_eagle3(cls):
        return f"{where} does not implement SupportsEagle3, so it cannot capture aux hidden states at all"
    seen: set[str] = {arch}
    pending = [cls]
    decoders: set[type] = set()
    while pending:
        found, nested = decoder_classes(pending.pop())
        decoders |= found
        for name in sorted(nested - seen):
            seen.add(name)
            pending.append(resolve_model_class([name])[0])
    if not decoders and model_config is not None:
        text_archs = getattr(getattr(model_config, "hf_text_config", None), "architectures", None) or []
        for name in text_archs:
            if name not in seen:
                seen.add(name)
                decoders |= decoder_classes(resolve_model_class([name])[0])[0]
    if not decoders:
        return (
            f"{where} builds no decoder that mixes in vLLM's EagleModelMixin, so nothing declares "
            f"{CAPABILITY}"
        )
    lacking = sorted(d.__qualname__ for d in decoders if not getattr(d, CAPABILITY, False))
    if lacking:
        return (
            f"{where} builds decoder(s) {lacking} that do not set {CAPABILITY}: their non-last "
            "pipeline stages drop the aux states they compute"
        )
    return None


def check_per_stage_capture(architectures: Sequence[str], pp_size: int, model_config: Any = None) -> None:
    """Reject `pp_size > 1` for a target that cannot capture aux states on every stage."""
    if pp_size <= 1:
        return
    problem = per_stage_capture_problem(architectures, model_config)
    if problem is not None:
        raise ConfigError(
            f"engine.pp_size={pp_size}: hidden-state capture under pipeline parallelism needs every "
            f"stage to capture the layers it owns, but {problem}. Use engine.pp_size=1 for this "
            f"target (without the gate vLLM fails later in _dummy_run with 'too many values to unpack')"
        )


# --- Kimi-K3 AttnRes boundary --------------------------------------------------------------------


def k3_attnres_boundary_violations(
    capture_ids: Sequence[int], num_layers: int, pp_size: int, partition: object = None
) -> list[int]:
    """The capture ids that end a non-last stage, in input order.

    `partition` overrides vLLM's split (a list or a `VLLM_PP_LAYER_PARTITION` string); None reads
    `VLLM_PP_LAYER_PARTITION` from the environment, as vLLM's workers do.
    """
    if pp_size <= 1:
        return []
    kwargs = {} if partition is None else {"partition": partition}
    parts = pp_partition(num_layers, pp_size, **kwargs)
    ends = {sum(parts[: r + 1]) for r in range(pp_size - 1)}
    return [k for k in capture_ids if k in ends]


def check_k3_attnres_boundary(
    capture_ids: Sequence[int], num_layers: int, pp_size: int, partition: object = None
) -> None:
    """Reject capture ids that would tap the raw prefix instead of the AttnRes mixture under PP."""
    bad = k3_attnres_boundary_violations(capture_ids, num_layers, pp_size, partition)
    if not bad:
        return
    kwargs = {} if partition is None else {"partition": partition}
    parts = pp_partition(num_layers, pp_size, **kwargs)
    raise ConfigError(
        f"capture ids {bad} (target_layer_ids {[k - 1 for k in bad]}) end a non-last pipeline stage of "
        f"the {num_layers}-layer Kimi-K3 target split {parts} over pp_size={pp_size}. With "
        f"{K3_STREAM_ENV}=1 such a tap has no AttnRes consumer on its stage, so it would not be the "
        "mixture that pp_size=1 exports and the feature would depend on the partition. Pick other "
        "target_layer_ids, move the stage boundary with VLLM_PP_LAYER_PARTITION, or unset "
        f"{K3_STREAM_ENV} (every tap is then the raw prefix at every pp_size)"
    )


def k3_attnres_stream_active(hf_text_config: Any, env: Mapping[str, str] | None = None) -> bool:
    """Whether Kimi-K3 taps AttnRes mixtures: the env flag (parsed as vLLM parses it) and AttnRes on."""
    env = os.environ if env is None else env
    raw = env.get(K3_STREAM_ENV, "0")
    try:
        flag = bool(int(raw))
    except ValueError as err:
        raise ConfigError(f"{K3_STREAM_ENV}={raw!r} is not an integer (vLLM reads it with int())") from err
    return flag and getattr(hf_text_config, "attn_res_block_size", None) is not None


# --- layer layout --------------------------------------------------------------------------------


def check_layout_against_vllm(model_config: ModelConfig, capture_ids: Sequence[int]) -> None:
    """Capture ids ascend and end at vLLM's own layer count for this target."""
    check_layer_layout(capture_ids, model_config.get_total_num_hidden_layers())


# --- entry point ---------------------------------------------------------------------------------


def preflight(
    engine_cfg: EngineConfig,
    model_dir: str | os.PathLike[str],
    capture_ids: Sequence[int],
    *,
    model_config: ModelConfig | None = None,
    env: Mapping[str, str] | None = None,
) -> ModelConfig:
    """Run every gate; returns the vLLM `ModelConfig` it read (reusable by the caller).

    Reads the HF config through vLLM's `ModelConfig` and imports the model class through vLLM's
    registry; loads no weights and touches no device. `env` defaults to `os.environ`, the
    environment the engine's workers inherit.
    """
    if model_config is None:
        from vllm.config import ModelConfig

        if not Path(model_dir).exists():
            raise ConfigError(f"target model directory {model_dir} does not exist")
        model_config = ModelConfig(
            model=str(model_dir), dtype=engine_cfg.dtype, max_model_len=engine_cfg.max_model_len
        )
    run_gates(model_config, engine_cfg.pp_size, capture_ids, env)
    return model_config


def run_gates(
    model_config: ModelConfig, pp_size: int, capture_ids: Sequence[int], env: Mapping[str, str] | None = None
) -> None:
    """The gates themselves, on a vLLM `ModelConfig` (what `preflight` and the follower share)."""
    check_layout_against_vllm(model_config, capture_ids)
    if pp_size > 1:
        check_every_stage_captures(capture_ids, model_config.get_total_num_hidden_layers(), pp_size)
    check_per_stage_capture(model_config.architectures, pp_size, model_config)
    if pp_size > 1 and k3_attnres_stream_active(model_config.hf_text_config, env):
        num_layers = model_config.get_total_num_hidden_layers()
        spec = (os.environ if env is None else env).get(PARTITION_ENV)
        parts = pp_partition(num_layers, pp_size, spec)
        check_k3_attnres_boundary(capture_ids, num_layers, pp_size, partition=parts)


def capture_ids_of(vllm_config: Any) -> list[int] | None:
    """The capture ids an `extract_hidden_states` engine config carries, or None for any other."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or spec.method != "extract_hidden_states":
        return None
    return [int(k) for k in spec.draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids]


def preflight_vllm_config(vllm_config: Any, env: Mapping[str, str] | None = None) -> None:
    """`preflight` for a node that holds only a built `VllmConfig` (a headless follower)."""
    ids = capture_ids_of(vllm_config)
    if ids is not None:
        run_gates(vllm_config.model_config, vllm_config.parallel_config.pipeline_parallel_size, ids, env)
