"""The trainer's input path alone: a real Mooncake master, an engine-like writer, the live source.

    .venv/bin/python benchmarks/trainer_input.py                          # 1k, 8k, 32k samples, CPU
    .venv/bin/python benchmarks/trainer_input.py --samples 8192 --compare # read ahead against inline
    python benchmarks/trainer_input.py --device cuda --samples 1024,8192  # a CUDA trainer's reader

What runs: this script launches its own `mooncake_master` (127.0.0.1, free ports) and a writer
process that publishes `N` samples shaped like the GPU default's (SmolLM2-135M-Instruct: hidden
576, aux layers 1, 14, 27 and the last, bf16, token counts drawn between `--tokens-min` and
`--tokens-max`) through `fragments.publish_stage`, each manifest appended to an engine queue
(`capture.queue.QueueWriter`), as an engine leader does; it stays at most `--ahead` samples ahead
of what the reader's read record says it read (the engines' backpressure). This process reads them
as trainer rank 0 does: `train.source.LiveSource` over `ManifestQueues`, spooling every sample
(`epochs=0`), then replays the spool (epoch 1). The consumer does nothing with a sample but count
it (or sleeps `--step-ms` per batch of 16, a GPU step's stand-in): samples/s is what the input
path can deliver. Printed per arm: samples/s over the whole pass, its first and last tenth and
their ratio (a path that slows as it grows shows < 1), MB/s, and the index bytes written per
sample. `--compare` runs the inline path (`read_ahead=0`: one sample at a time on the trainer's
thread) beside the default, and prints the ratio of medians.

Goals (issue "Feed the GPU"): the input path delivers at least 5x what the draft's GPU step
consumes (batch 16), and the last tenth of a 32k-sample pass runs at least 0.9x the first.

Measured on this project's 2-core CPU machine (Intel Xeon, 24 GiB; 2026-12-07, main at 40b4308's
parent; the writer, the master and the reader share the two cores, so every live figure is the
writer's pace, about 260-420 samples/s; the CUDA figures are for the next GPU lease, `gpu_node.sh
start install trainer_input`):

    .venv/bin/python benchmarks/trainer_input.py --samples 32768 --step-ms 40
      32768 live 256.6/s (first tenth 264.7, last tenth 285.3: x1.08) | replay 376.2/s (x0.98)
            | index 36 B/sample | busy share: live 0.66 (the writer's pace), replay 0.95
    .venv/bin/python benchmarks/trainer_input.py --samples 2048 --compare --step-ms 40 [--workers 1]
      inline: replay 304.9/s, busy 0.77 | read ahead: replay 386.9/s, busy 0.97 (x1.27);
      live x1.68 (workers 1), x1.56 (workers 4)
    .venv/bin/python benchmarks/trainer_input.py --samples 1024,8192 --compare     (no consumer)
      8192: live inline 310.5/s, read ahead 249.0/s; replay inline 1979.8/s, read ahead 1014.8/s

What they say:
- The index costs the same 33-36 bytes a sample at 1k, 8k and 32k (one line per 256 MiB shard):
  the spool no longer grows its cost with its size. Before this (one-sample shards, the whole
  index rewritten and fsynced per sample) the 4096-conversation rung's trainer fell from 29 to 19
  samples/s on an H100 (2026-12-07).
- A 32k-sample pass keeps its pace: last tenth 1.08x the first live, 0.98x in the replay (goal
  >= 0.9x).
- With a consumer that takes 40 ms a batch of 16 (400 samples/s, a GPU step's stand-in), reading
  ahead keeps it 0.95-0.97 busy in the replay against 0.77 inline: the fetch and checks of the
  next batch overlap the step. With no consumer at all, on two cores shared with the writer, the
  worker threads only add switching (replay 1015/s against 1980/s inline, GIL-bound Python per
  sample); both deliver several times what a SmolLM2 draft's step consumes (1000 steps of 16 in
  135 s on an H200, 2026-12-04: about 120 samples/s): 8x read ahead, 16x inline.
- The CUDA reader (copy and check on the GPU, a side stream per worker), on one H100 node
  (16 cores; torch 2.11.0+cu130 of the node's image, not the wheelhouse's; Mooncake
  0.3.13.post1 from the wheelhouse carried as wheels; 2026-12-07, main at e99f0d2):

      python3 benchmarks/trainer_input.py --device cuda --samples 4096 --compare --step-ms 40
        inline      live 168.9/s (x1.06) | replay 276.0/s (x0.98) | busy live 0.42, replay 0.69
        read ahead  live 248.5/s (x1.08) | replay 370.2/s (x1.04) | busy live 0.63, replay 0.93
        read ahead / inline: live x1.47, replay x1.34   (benchmarks/results/trainer_input_h100.json)

  Reading ahead keeps the stand-in GPU step 0.93 busy in the replay (its ceiling is 400/s) against
  0.69 inline, and neither pass slows as it grows (last tenth 0.98-1.08x the first). Live, both
  arms run at the writer's pace (one writer process publishing through Mooncake's TCP transport:
  199 and 293 samples/s), not the reader's. The 32768-sample pass did not finish in the 200 s it
  was given there (writer-bound at about 290/s, it needs about 4 minutes): its CUDA figure and the
  GPU's busy share in a real rung (`summary.json`'s `gpu_busy`) are still to measure.
- The first real rung with this path (one H100, 2026-12-08, DFlash 4096 x 2048,
  `docs/what-ran-where.md`) shows what the stand-in step hides: the trainer's own main thread.
  Its replay ran at 155-185 samples/s with the GPU 3-6 % busy (6.5 % over the run), and py-spy
  found the main thread 80 % busy, 65 % of that in `collate`'s host padding, which a sleeping
  consumer never pays. The reader was not the limit there; the collate is now packed
  (`benchmarks/collate.py`), and the next rung measures what it buys.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import hpctoolkit.store  # noqa: E402, F401  (import order)
from hpctoolkit.capture.manifest import build_manifest  # noqa: E402
from hpctoolkit.integrity import devsum  # noqa: E402
from hpctoolkit.store.config import StoreConfig  # noqa: E402

NUM_LAYERS = 30
CAPTURE_IDS = [1, 14, 27, NUM_LAYERS]
BATCH = 16


def _cfg(args: argparse.Namespace) -> StoreConfig:
    return StoreConfig(
        global_segment_size=args.segment_mb << 20,
        local_buffer_size=256 << 20,
        kv_lease_ttl_s=60.0,
        get_retry_max_wait_seconds=60.0,
    )


def _tokens(i: int, args: argparse.Namespace) -> int:
    # A fixed spread of lengths (no RNG state to share between the processes).
    span = args.tokens_max - args.tokens_min + 1
    return args.tokens_min + (i * 7919) % span


# -- the writer (an engine leader) ----------------------------------------------------------------


def _writer(args: argparse.Namespace) -> None:
    from hpctoolkit.capture.queue import QueueWriter
    from hpctoolkit.store import fragments
    from hpctoolkit.store.mooncake import MooncakeStore

    store = MooncakeStore(args.address, _cfg(args), role="writer")
    algo = devsum.ALGORITHM if args.device == "cuda" else "xxh3_64"
    g = torch.Generator().manual_seed(0)
    layers = {
        k: torch.randn(args.tokens_max, args.hidden, generator=g).to(torch.bfloat16) for k in CAPTURE_IDS
    }
    if args.device == "cuda":
        layers = {k: v.cuda() for k, v in layers.items()}
    ids = torch.randint(0, 49152, (args.tokens_max,), generator=g)
    q = QueueWriter(args.run_dir, 0, args.prefix)
    q.reset()
    record = Path(args.read_record)
    read = 0
    t0 = time.perf_counter()
    for i in range(args.n):
        while i - read >= args.ahead:
            time.sleep(0.05)
            with contextlib.suppress(OSError, ValueError):
                read = int(json.loads(record.read_text())["samples"])
        t = _tokens(i, args)
        m = build_manifest(
            f"{args.prefix}-s{i}", CAPTURE_IDS, t, args.hidden, NUM_LAYERS, 1, "bfloat16", sums_algorithm=algo
        )
        rows = {k: v[:t] for k, v in layers.items()}
        sums = (
            dict(zip(rows, devsum.digests8(list(rows.values())), strict=True))
            if args.device == "cuda"
            else None
        )
        fragments.publish_stage(store, m, 0, rows, ids[:t], sums)
        q.append(m.to_json())
    q.done()
    (Path(args.run_dir) / "writer.json").write_text(
        json.dumps({"published_per_s": args.n / (time.perf_counter() - t0)})
    )
    # The fragments live in this process's segment: it stays until the reader has read them all
    # (an engine leader waits for the trainers' `drained` record the same way).
    while read < args.n:
        time.sleep(0.05)
        with contextlib.suppress(OSError, ValueError):
            read = int(json.loads(record.read_text())["samples"])
    store.close()


# -- the reader (trainer rank 0) ------------------------------------------------------------------


def _pass(it: Any, step_s: float) -> tuple[list[float], int, float]:
    """Each sample's arrival time, the bytes read, and the seconds the consumer was busy: it
    sleeps `step_s` per batch (the GPU step's stand-in)."""
    times, nbytes, busy = [], 0, 0.0
    for n, sample in enumerate(it, start=1):
        times.append(time.perf_counter())
        nbytes += sample.manifest.nbytes
        if step_s and n % BATCH == 0:
            t = time.perf_counter()
            time.sleep(step_s)
            busy += time.perf_counter() - t
    return times, nbytes, busy


def _rate(times: list[float]) -> dict[str, float]:
    """Samples/s from the first sample's arrival on (the writer's start-up is not the reader's)."""
    t0, times = times[0], times[1:]
    n = len(times)
    tenth = max(n // 10, 1)
    first = tenth / max(times[tenth - 1] - t0, 1e-9)
    last = tenth / max(times[-1] - times[-tenth - 1], 1e-9) if n > tenth else first
    return {
        "all": n / max(times[-1] - t0, 1e-9),
        "first_tenth": first,
        "last_tenth": last,
        "last_over_first": last / first,
    }


def run_arm(n: int, arm: str, args: argparse.Namespace, address: str, work: Path) -> dict[str, Any]:
    from hpctoolkit.store.mooncake import MooncakeStore
    from hpctoolkit.train.source import LiveSource, ManifestQueues

    run_dir = work / f"run-{arm}-{n}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    prefix = f"bench{os.getpid()}{arm}{n}"
    spool = run_dir / "spool"
    inline = arm == "inline"
    src = LiveSource(
        "",
        expected=n,
        store_factory=functools.partial(MooncakeStore, address, _cfg(args), role="reader"),
        retry_max_wait_s=60.0,
        follow=ManifestQueues(str(run_dir), (prefix,), (n,), stall_timeout_s=120),
        spool_dir=str(spool),
        epochs=0,
        engine_prefixes=(prefix,),
        device="cuda" if args.device == "cuda" else None,
        read_ahead=0 if inline else args.read_ahead,
        fetch_workers=0 if inline else args.workers,
    )
    argv = [
        sys.executable,
        __file__,
        "--role=writer",
        f"--address={address}",
        f"--n={n}",
        f"--prefix={prefix}",
    ]
    argv += [f"--run-dir={run_dir}", f"--read-record={spool / 'read-rank0.json'}", f"--ahead={args.ahead}"]
    argv += [f"--hidden={args.hidden}", f"--tokens-min={args.tokens_min}", f"--tokens-max={args.tokens_max}"]
    argv += [f"--segment-mb={args.segment_mb}", f"--device={args.device}"]
    log = open(work / f"writer-{arm}-{n}.log", "wb")  # noqa: SIM115
    writer = subprocess.Popen(argv, stdout=log, stderr=log)
    try:
        live, nbytes, live_busy = _pass(src(0, 1, 0, 0), args.step_ms / 1000)
        if writer.wait(120) != 0:
            raise SystemExit(f"writer failed; see {log.name}")
        replay, _, replay_busy = _pass(src(0, 1, 1, 0), args.step_ms / 1000)
    finally:
        if writer.poll() is None:
            writer.kill()
        log.close()
    index = (spool / "rank0" / "index.jsonl").stat().st_size
    out = {
        "samples": n,
        "arm": arm,
        "device": args.device,
        "bytes": nbytes,
        "live": _rate(live),
        "replay": _rate(replay) if len(replay) > 1 else None,
        "live_MBps": nbytes / max(live[-1] - live[0], 1e-9) / 1e6,
        "index_bytes_per_sample": index / n,
        "writer_per_s": json.loads((run_dir / "writer.json").read_text())["published_per_s"],
        # With --step-ms: the consumer's (the GPU's) busy share of the pass, from its first sample.
        "live_busy_share": live_busy / max(live[-1] - live[0], 1e-9) if args.step_ms else None,
        "replay_busy_share": replay_busy / max(replay[-1] - replay[0], 1e-9)
        if args.step_ms and len(replay) > 1
        else None,
    }
    shutil.rmtree(run_dir, ignore_errors=True)  # the spool: GBs
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", default="1024,8192,32768")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--tokens-min", type=int, default=64)
    p.add_argument("--tokens-max", type=int, default=256, help="the GPU default's answers run to 1280")
    p.add_argument("--read-ahead", type=int, default=2 * BATCH, help="as a trainer of batch 16 reads")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument(
        "--ahead", type=int, default=1024, help="samples the writer may publish beyond what was read"
    )
    p.add_argument("--segment-mb", type=int, default=4096)
    p.add_argument("--step-ms", type=float, default=0.0, help="the consumer's time per batch of 16")
    p.add_argument("--compare", action="store_true", help="also the inline path (no read ahead)")
    p.add_argument("--work", type=Path, default=None, help="where the spools go (default: a temporary dir)")
    p.add_argument("--json", type=Path, default=None)
    # The writer's own arguments.
    p.add_argument("--role", choices=["writer"])
    p.add_argument("--address")
    p.add_argument("--n", type=int)
    p.add_argument("--prefix")
    p.add_argument("--run-dir")
    p.add_argument("--read-record")
    args = p.parse_args()
    if args.role == "writer":
        _writer(args)
        return

    from hpctoolkit.store.mooncake_master import launch_master

    work = args.work or Path(tempfile.mkdtemp(prefix="trainer_input_"))
    work.mkdir(parents=True, exist_ok=True)
    master = launch_master(_cfg(args), work)
    rows = []
    try:
        for n in [int(x) for x in args.samples.split(",")]:
            for arm in ["inline", "ahead"] if args.compare else ["ahead"]:
                r = run_arm(n, arm, args, master.address, work)
                rows.append(r)
                rep = r["replay"] or {}
                print(
                    f"{n:>6} {arm:<7} live {r['live']['all']:8.1f}/s (first tenth {r['live']['first_tenth']:8.1f}, "
                    f"last {r['live']['last_tenth']:8.1f}, x{r['live']['last_over_first']:.2f}) "
                    f"{r['live_MBps']:7.1f} MB/s | replay {rep.get('all', 0):8.1f}/s "
                    f"(x{rep.get('last_over_first', 0):.2f}) | index {r['index_bytes_per_sample']:.0f} B/sample"
                    f" | writer {r['writer_per_s']:.0f}/s"
                    + (
                        f" | busy live {r['live_busy_share']:.2f} replay {r['replay_busy_share']:.2f}"
                        if args.step_ms
                        else ""
                    ),
                    flush=True,
                )
    finally:
        master.stop()
    if args.compare:
        for n in sorted({r["samples"] for r in rows}):
            by = {r["arm"]: r for r in rows if r["samples"] == n}
            live = by["ahead"]["live"]["all"] / by["inline"]["live"]["all"]
            rep = (by["ahead"]["replay"] or {}).get("all", 0) / max(
                (by["inline"]["replay"] or {}).get("all", 1e-9), 1e-9
            )
            print(f"{n:>6} read ahead / inline: live x{live:.2f}, replay x{rep:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    print(f"median live samples/s over every arm: {statistics.median(r['live']['all'] for r in rows):.1f}")


if __name__ == "__main__":
    main()
