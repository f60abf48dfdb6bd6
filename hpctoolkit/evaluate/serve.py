"""Served acceptance: vLLM runs greedy speculative decoding of the export with its target.

The vLLM speculative `method` comes from the export's family record (`models.registry.
serving_for`), and vLLM's spec-decode counters give
`acceptance_length = 1 + num_accepted_tokens / num_drafts` and per-position acceptance
`num_accepted_tokens_per_pos[k] / num_drafts`. `ServingSession` keeps one engine up for several
`generate` calls; vLLM's counters are cumulative, so each call's are the difference of the readings
around it (`counter_delta`), and groups of calls add up (`add_counters`). `serve` is one call.

vLLM's draft `load_weights` does not report missing weights, so every parameter of the served
draft is set to NaN before loading and checked after the engine is up (after vLLM attached the
embedding and head it shares from the target): a parameter still NaN was never loaded, and
evaluation fails with its name.

While `reporting(on_done)` is active, every `generate` call tells `on_done(n)` as its requests
finish (vLLM's progress-bar hook), so the evaluate role can count questions served however the
calls nest (`evaluate`, `serve_chats`) without a callback in each signature.

A family whose record names a `cpu_unservable` reason (DSpark: vLLM 0.32 serves it only in its
V2 model runner, which needs Triton) is refused when no GPU is present.
"""

from __future__ import annotations

import contextlib
import contextvars
import gc
import importlib
import io
import os
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hpctoolkit.config.precision import engine_dtype
from hpctoolkit.engine.env import cuda_visible, detect_backend, gpu_memory_share
from hpctoolkit.errors import ConfigError, DataIntegrityError
from hpctoolkit.models.families import read_config_json, serving_for

_ON_DONE: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar(
    "hpctoolkit_serve_on_done", default=None
)


@contextlib.contextmanager
def reporting(on_done: Callable[[int], None]) -> Iterator[None]:
    """Within the block, `ServingSession.generate` calls `on_done(n)` as `n` requests finish."""
    token = _ON_DONE.set(on_done)
    try:
        yield
    finally:
        _ON_DONE.reset(token)


def _counting_bar(on_done: Callable[[int], None]) -> Callable[..., Any]:
    """A tqdm class for `LLM.generate(use_tqdm=...)` that draws nothing and counts into `on_done`."""
    from tqdm import tqdm

    class CountingBar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "file": io.StringIO(), "mininterval": 3600.0})

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            on_done(int(n or 0))
            return shown

    return CountingBar


def serving_method(export_dir: str | os.PathLike) -> str:
    """The vLLM speculative method for the export in `export_dir`; refuses what cannot be served here."""
    cfg_path = Path(export_dir) / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(
            f"{export_dir} holds no config.json; expected a directory written by hpctoolkit.models.export"
        )
    raw = read_config_json(cfg_path)
    serving = serving_for(raw)
    if serving.cpu_unservable and not cuda_visible():
        arch = (raw.get("architectures") or [serving.served_architecture])[0]
        raise ConfigError(f"cannot serve {arch} on the CPU: {serving.cpu_unservable}")
    return serving.vllm_method


def _engine_environment() -> None:
    """Apply the engine environment (in-process, CPU) before vLLM is imported; user values win."""
    from hpctoolkit.engine.env import engine_env

    backend = detect_backend()
    # Serving, not capture: vLLM picks its own runner (DSpark drafts need V2 on CUDA).
    env = engine_env(backend, in_process=True, world_size=1, cpu_kvcache_space_gb=1, pin_v1_runner=False)
    for k, v in env.items():
        os.environ.setdefault(k, v)


def _memory_share() -> dict[str, float]:
    """The serving engine's `gpu_memory_utilization` on CUDA: HPCTOOLKIT_GPU_MEMORY_UTILIZATION, else
    0.9 of what is free now (vLLM's own 0.9 of the whole GPU refuses to start beside anything else
    still holding memory on it, such as a trainer or an engine of the same run leaving)."""
    if detect_backend() != "cuda":
        return {}
    share = gpu_memory_share()
    if share:
        return share
    free, total = torch.cuda.mem_get_info()
    return {"gpu_memory_utilization": round(min(0.9, 0.9 * free / total), 3)}


class LoadAudit:
    """Wraps a vLLM draft class's `load_weights`: NaN-fills its parameters first, keeps the instance."""

    def __init__(self, cls: Any) -> None:
        self.cls = cls
        self.original = cls.load_weights
        self.instances: list[torch.nn.Module] = []

    def __enter__(self) -> LoadAudit:
        audit = self

        def load_weights(model, weights, *args, **kwargs):
            with torch.no_grad():
                for p in model.parameters():
                    if p.is_floating_point():
                        p.fill_(float("nan"))
            audit.instances.append(model)
            return audit.original(model, weights, *args, **kwargs)

        self.cls.load_weights = load_weights
        return self

    def __exit__(self, *exc: object) -> None:
        self.cls.load_weights = self.original

    def unloaded(self) -> list[str]:
        """Parameters of the served draft still at the NaN sentinel (never loaded, never shared)."""
        if not self.instances:
            raise DataIntegrityError(
                f"vLLM never called {self.cls.__name__}.load_weights; the audit saw nothing"
            )
        bad = []
        for model in self.instances:
            for name, p in model.named_parameters():
                if _unused_by_design(model, name):
                    continue
                if p.is_floating_point() and bool(torch.isnan(p).any()):
                    bad.append(name)
        return sorted(bad)


def _unused_by_design(model: torch.nn.Module, name: str) -> bool:
    """Parameters vLLM allocates but never reads in this configuration.

    DFlash's `mask_embedding` is read only when a `mask_embedding.pt` override was loaded
    (`has_separate_mask_embedding`); otherwise masked slots embed `mask_token_id` through the
    shared embedding (qwen3_dflash.py, `embed_input_ids`).
    """
    if name.endswith("mask_embedding"):
        inner = getattr(model, "model", model)
        return not getattr(inner, "has_separate_mask_embedding", False)
    return False


def _draft_class(export_dir: Path) -> type:
    from vllm.model_executor.models.registry import _SPECULATIVE_DECODING_MODELS

    arch = read_config_json(export_dir)["architectures"][0]
    module, cls = _SPECULATIVE_DECODING_MODELS[arch]
    return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)


def _metric_values(metrics: list[Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for m in metrics:
        if not m.name.startswith("vllm:spec_decode"):
            continue
        if hasattr(m, "values"):
            prev = out.get(m.name)
            vals = list(m.values)
            out[m.name] = vals if prev is None else [a + b for a, b in zip(prev, vals, strict=True)]
        elif hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def acceptance_from_counters(counters: dict[str, Any], k: int) -> dict[str, Any]:
    """Served acceptance from vLLM's spec-decode counters (see the module docstring)."""
    drafts = float(counters.get("vllm:spec_decode_num_drafts", 0))
    accepted = float(counters.get("vllm:spec_decode_num_accepted_tokens", 0))
    per_pos = [float(x) for x in counters.get("vllm:spec_decode_num_accepted_tokens_per_pos", [0] * k)]
    if drafts <= 0:
        raise DataIntegrityError("vLLM reported no speculative drafts; was the draft attached?")
    return {
        "num_drafts": drafts,
        "num_draft_tokens": float(counters.get("vllm:spec_decode_num_draft_tokens", 0)),
        "num_accepted_tokens": accepted,
        "acceptance_length_incl_bonus": 1.0 + accepted / drafts,
        "acc_len_excl_bonus": accepted / drafts,
        "acceptance_rate_per_pos": [x / drafts for x in per_pos],
    }


def counter_delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's cumulative spec-decode counters gained between two readings (lists by position)."""
    out: dict[str, Any] = {}
    for name, value in after.items():
        prev = before.get(name)
        if isinstance(value, list):
            prev = prev if prev is not None else [0] * len(value)
            out[name] = [a - b for a, b in zip(value, prev, strict=True)]
        else:
            out[name] = value - (prev or 0)
    return out


def add_counters(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The counters of several calls added up (`counter_delta`'s inverse over consecutive calls)."""
    out: dict[str, Any] = {}
    for part in parts:
        for name, value in part.items():
            prev = out.get(name)
            if isinstance(value, list):
                out[name] = list(value) if prev is None else [a + b for a, b in zip(prev, value, strict=True)]
            else:
                out[name] = value + (prev or 0)
    return out


def model_len(longest_prompt: int, max_tokens: int, num_speculative_tokens: int) -> int:
    """vLLM's `max_model_len` for prompts up to `longest_prompt` tokens generating `max_tokens`."""
    return 64 * ((longest_prompt + max_tokens + num_speculative_tokens + 64) // 64)


class ServingSession:
    """One vLLM engine serving the export with its target (in this process), for several calls.

    `with ServingSession(...) as s:` starts the engine (the draft's weights audited as loaded,
    see the module docstring); each `s.generate(...)` runs one greedy batch and returns its
    outputs and the spec-decode counters *that call* added (cumulative readings differenced);
    leaving the block frees the engine. Calls run one at a time, from the thread that opened it.
    """

    def __init__(
        self,
        export_dir: str | os.PathLike,
        target_dir: str | os.PathLike,
        *,
        num_speculative_tokens: int,
        max_model_len: int,
        max_num_seqs: int = 8,
        dtype: str = "auto",
    ) -> None:
        self.export_dir, self.target_dir = Path(export_dir), Path(target_dir)
        # `engine.dtype`; auto as there (`config/precision.py`): vLLM's own auto would take the
        # checkpoint's bf16 and emulate it on a CPU without bf16 instructions (1-2 tokens/s).
        self.dtype = engine_dtype(dtype)
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.method = serving_method(self.export_dir)
        self.engine_start_s = 0.0
        self._llm: Any = None
        self._last: dict[str, Any] = {}
        self.start_counters: dict[str, Any] = {}

    def __enter__(self) -> ServingSession:
        _engine_environment()
        from vllm import LLM

        t0 = time.monotonic()
        with LoadAudit(_draft_class(self.export_dir)) as audit:
            self._llm = LLM(
                model=str(self.target_dir),
                speculative_config={
                    "method": self.method,
                    "model": str(self.export_dir),
                    "num_speculative_tokens": self.num_speculative_tokens,
                },
                enforce_eager=True,
                dtype=self.dtype,
                disable_log_stats=False,
                # Each output carries its own acceptance histogram (`request_counters`).
                per_request_spec_decode_metrics="summary",
                max_model_len=self.max_model_len,
                max_num_seqs=self.max_num_seqs,
                seed=0,
                **_memory_share(),
            )
        try:
            self.engine_start_s = time.monotonic() - t0
            unloaded = audit.unloaded()
            if unloaded:
                raise DataIntegrityError(
                    f"vLLM left draft parameters of {self.export_dir} unloaded (still NaN after loading): "
                    f"{unloaded}"
                )
            self._last = self.start_counters = self.counters()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._llm is not None:
            self._llm = None
            gc.collect()

    def counters(self) -> dict[str, Any]:
        """vLLM's cumulative spec-decode counters (`start_counters` is their reading once it was up)."""
        if self._llm is None:
            raise RuntimeError("the serving session is not open")
        return _metric_values(self._llm.get_metrics())

    def generate(
        self, prompts_token_ids: list[list[int]], *, max_tokens: int, ignore_eos: bool
    ) -> dict[str, Any]:
        """Greedy speculative decoding of `prompts_token_ids`: `outputs`, this call's `counters`, `generate_s`."""
        if self._llm is None:
            raise RuntimeError("the serving session is not open")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        room = self.max_model_len - max_tokens - self.num_speculative_tokens
        longest = max(len(p) for p in prompts_token_ids)
        if longest > room:
            raise DataIntegrityError(
                f"a prompt of {longest} tokens leaves no room for {max_tokens} more in the engine's "
                f"max_model_len {self.max_model_len}"
            )
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
        t0 = time.monotonic()
        outs = self._llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts_token_ids],
            params,
            use_tqdm=False if (on_done := _ON_DONE.get()) is None else _counting_bar(on_done),
        )
        generate_s = time.monotonic() - t0
        now = self.counters()
        delta, self._last = counter_delta(now, self._last), now
        return {
            "outputs": [list(o.outputs[0].token_ids) for o in outs],
            "counters": delta,
            "request_counters": [
                request_counters(o.outputs[0].spec_decode_metrics, delta, self.num_speculative_tokens)
                for o in outs
            ],
            "generate_s": generate_s,
        }


def request_counters(metrics: Any, like: Mapping[str, Any], k: int) -> dict[str, Any]:
    """One request's spec-decode counters, from its acceptance histogram (`h[j]`: verifications
    that accepted `j` drafts), with the keys of the engine's counters `like`: drafts `sum h`,
    accepted `sum j h[j]`, accepted at position `p` `sum_{j > p} h[j]`. A request vLLM reported no
    histogram for fails: its acceptance would silently drop out of a per-group figure."""
    if metrics is None:
        raise DataIntegrityError(
            "vLLM returned an output without per-request spec-decode metrics "
            "(per_request_spec_decode_metrics); per-group acceptance cannot be counted"
        )
    h = [int(x) for x in metrics.histogram]
    if len(h) != k + 1:
        raise DataIntegrityError(f"a per-request acceptance histogram has {len(h)} bins, expected {k + 1}")
    values: dict[str, Any] = {
        "vllm:spec_decode_num_drafts": sum(h),
        "vllm:spec_decode_num_accepted_tokens": sum(j * n for j, n in enumerate(h)),
        "vllm:spec_decode_num_draft_tokens": int(metrics.num_draft_tokens),
        "vllm:spec_decode_num_accepted_tokens_per_pos": [sum(h[p + 1 :]) for p in range(k)],
    }
    unknown = sorted(set(like) - set(values))
    if unknown:
        raise DataIntegrityError(f"vLLM counts spec-decode metrics a request cannot be split into: {unknown}")
    return {name: values[name] for name in like} if like else values


def serve(
    export_dir: str | os.PathLike,
    target_dir: str | os.PathLike,
    prompts_token_ids: list[list[int]],
    *,
    num_speculative_tokens: int,
    max_tokens: int,
    dtype: str = "auto",
) -> dict[str, Any]:
    """Greedy speculative decoding in vLLM (in this process), EOS ignored; outputs, counters, audit."""
    longest = max(len(p) for p in prompts_token_ids)
    with ServingSession(
        export_dir,
        target_dir,
        num_speculative_tokens=num_speculative_tokens,
        max_model_len=model_len(longest, max_tokens, num_speculative_tokens),
        dtype=dtype,
    ) as session:
        got = session.generate(prompts_token_ids, max_tokens=max_tokens, ignore_eos=True)
    return {
        "method": session.method,
        "outputs": got["outputs"],
        "counters": got["counters"],
        "engine_start_s": session.engine_start_s,
        "generate_s": got["generate_s"],
        "unloaded_parameters": [],
        **acceptance_from_counters(got["counters"], num_speculative_tokens),
    }
