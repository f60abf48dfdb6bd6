"""Served acceptance on MT-Bench against training tokens, DFlash and Eagle3, on the embedded default.

    .venv/bin/python benchmarks/acceptance.py                       # the default sweep (hours on 2 cores)
    python benchmarks/acceptance.py --ladder                        # the GPU ladder (one CUDA GPU)
    python benchmarks/acceptance.py --ladder --points 4096:3000 --families dflash   # one rung
    .venv/bin/python benchmarks/acceptance.py --points 128:400,512:1600 --families dflash
    .venv/bin/python benchmarks/acceptance.py --out runs/acceptance --plot acceptance.png
    .venv/bin/python benchmarks/acceptance.py --no-run                  # table and plot of what ran

`--ladder` is the acceptance ladder on one GPU: the GPU default (`recipes/local_gpu.yaml`) on
conversations the target writes itself (`data.prompts=builtin:magpie`, one user turn sampled from
its template's pre-query text, then answered greedy), rungs `LADDER_POINTS` (1k to 32k
conversations), served at k=3 on MT-Bench and HumanEval. Per rung it adds the trainer's wall time
and the GPU-seconds (the job's wall time on its one GPU), and the plot gets a line per family and
set. Not run yet: the GPU time of 2026-12-04 went to the pipeline's first run (`make run` on one
H200: 1024 `builtin:chat` conversations x 1000 steps served 1.27 on MT-Bench, 1.29 on HumanEval).

Each point is one whole `make run` job (`python -m hpctoolkit.submit recipes/local.yaml`): the
target (SmolLM2-135M-Instruct) answers `N` locally built chat prompts, the draft trains `S`
steps on its answers, and vLLM serves draft and target on MT-Bench's 80 questions, both turns.
A point is `N:S`; the step count grows with the data so that each point sees its data about
as often. What comes out, per family and point: the supervised tokens the draft was trained on,
served acceptance length on MT-Bench (incl. the bonus token, k = `evaluate.num_speculative_tokens`),
its per-category spread, and the trainer's own simulated figure; a table on stdout, every point's
summary under `--out`, and the plot (served acceptance against training tokens, one line per
family). Points already run (their summary.json present under `--out`) are read, not rerun.

Measured (2026-12-02, 2 cores; only a smoke point, the sweep is hours of CPU):
`benchmarks/acceptance.py --points 32:40 --families dflash,eagle3 --out /tmp/acc
evaluate.questions_per_category=1 data.regenerate_tokens=64 training.warmup_steps=5`:
dflash 32 x 40: 12,615 supervised tokens, served 1.04 (1.00-1.11 by category), trainer 1.09,
211 s. eagle3 at SmolLM2's whole vocabulary: 46 s a training step here (seven test-time steps
of 49,152-way logits), stopped after 8 of 40. The Eagle3 config now prunes to 8,192 ids, chosen
in the live run from the engine's counts of every sample's supervised tokens: the same 32 x 40
point, `python -m hpctoolkit.submit recipes/local.yaml draft.config=recipes/draft_models/smollm2_eagle3.json
training.init_layers_from_target=[] data.num_samples=32 data.regenerate_tokens=64
training.steps=40 training.warmup_steps=5 evaluate.questions_per_category=1` (two helpers' work
sharing the cores): about 4 s a step, 284.5 s in all, 12,615 supervised tokens, served 1.116 on
8 questions (1.06-1.20 by category; turn 1 1.100, turn 2 1.133), replayed 1.111, trainer 1.37.
The embedded default itself (128 x 300, DFlash) serves 1.13 (docs/running.md).

Measured (2026-12-03, this 2-core AVX2-only machine, float32 by `auto`, full evaluation: 80
questions x 2 turns, 64 tokens an answer, k = 3; the points one after another in the background
of other work, so wall times are upper bounds):

    .venv/bin/python benchmarks/acceptance.py --families dflash --points 64:200
    .venv/bin/python benchmarks/acceptance.py --families eagle3 --points 64:200
    .venv/bin/python benchmarks/acceptance.py --families dflash --points 256:800
    .venv/bin/python benchmarks/acceptance.py --families eagle3 --points 128:300     # after the Eagle3 speed-up
    .venv/bin/python benchmarks/acceptance.py --no-run --points 64:200,256:800   # the table

| family | samples x steps | supervised tokens (all steps) | served on MT-Bench | by category | trainer, own data | wall   |
|--------|-----------------|-------------------------------|--------------------|-------------|-------------------|--------|
| dflash | 64 x 200        | 107,818                       | 1.09               | 1.07-1.12   | 1.38              | 816 s  |
| dflash | 128 x 300 (`make run`) | ~162k (estimated)      | 1.13               | 1.10-1.16   | 1.41              | 901 s  |
| dflash | 256 x 800       | 443,762                       | 1.16               | 1.13-1.21   | 1.98              | 1616 s |
| eagle3 | 64 x 200        | 107,818                       | 1.19               | 1.15-1.24   | 2.38              | 4244 s |
| eagle3 | 128 x 300       | 166,124                       | 1.24               | 1.20-1.34   | 2.74              | 2879 s |

What they say: on the same 64 samples Eagle3 serves 1.19 where DFlash serves 1.09, and both
learn their training data far better than they generalise (trainer 2.38 and 1.98 on their own
samples, served 1.19 and 1.16): the gap is distinct data, not steps. Four times the samples and
steps moved DFlash from 1.09 to 1.16, about +0.035 a doubling of supervised tokens; 2.0 at that
rate is out of reach of any CPU run, and the published drafts that serve 2.5-3.5 train on
hundreds of thousands of distinct conversations. Eagle3 ran at 16-18 s a step here (its target
head over 49,152 ids ran 14 times a forward; `models/eagle3/loss.py::eagle3_target_side` now
runs it once, 33.7 -> 14.8 s a step on one core; the 128 x 300 point ran with it, 7.2-8.2 s a
step on two cores). Eagle3 128 x 300 serves 1.24, above DFlash's 1.16 at 256 x 800.

Measured (2026-12-04, a 2-core Xeon with AMX, bf16 by `auto`, idle, the same full evaluation),
DFlash as `make run` trains it, each point one `make run` with the sizes as arguments (the
default first):

    make run
    make run ARGS="data.num_samples=192 training.steps=600 training.checkpoint_every=300"
    make run ARGS="data.num_samples=320 training.steps=1000 training.checkpoint_every=500"

| family | samples x steps        | supervised tokens (all steps) | served on MT-Bench | by category | trainer, own data | wall  |
|--------|------------------------|-------------------------------|--------------------|-------------|-------------------|-------|
| dflash | 64 x 200 (`make run`)  | 111,387                       | 1.09               | 1.07-1.12   | 1.31              | 201 s |
| dflash | 192 x 600              | 335,262                       | 1.16               | 1.14-1.19   | 1.71              | 335 s |
| dflash | 320 x 1000             | 550,953                       | 1.19               | 1.14-1.24   | 2.07              | 503 s |

Five times the samples and steps: +0.10 served, +0.76 on the training data. The served figure
rises about 0.04 a doubling of supervised tokens on this machine's curve, in line with the AVX2
points above; the first speculative position's acceptance doubles (8.5 % -> 17.2 %) while the
second stays under 2 %.

Why the second position (2026-12-04, issue 32 item 4; AMX, bf16, `make run`'s 64 x 200 data, the
same 64 regenerated rows for both drafts; served on MT-Bench's first two questions of each category,
both turns, 32 requests, 64 tokens, k = 3, then each request replayed by our trainer's code):

| DFlash draft      | trainer, own data: accuracy / chains reaching (%) | served per position (%) | replayed (%)       | served / replayed |
|-------------------|----------------------------------------------------|-------------------------|--------------------|-------------------|
| 1 layer (before)  | 25.1, 21.0, 14.0 / 25.1, 3.5, 0.3 (1.29)           | 8.86, 0.40, 0.06        | 8.73, 0.34, 0.06   | 1.093 / 1.091     |
| 2 layers (now)    | 35.3, 23.6, 18.5 / 35.3, 8.8, 3.0 (1.47)           | 11.22, 0.58, 0.00       | 11.16, 0.64, 0.00  | 1.118 / 1.118     |

Not a train/serve mismatch: vLLM and the replay agree at every position (within 0.13 points),
and vLLM's `qwen3_dflash.py` / `v1/spec_decode/dflash.py` lay the block out as
`models/dflash/layout.py` does (the bonus token then k mask tokens at positions P .. P+k,
non-causal within the block; context K/V from `hidden_norm(fc(target states))` at positions < P,
the states of `target_layer_ids + 1`, before the final norm; k_norm and RoPE at the context
positions). The recipe was the limit: with one decoder layer a block's slots read only each other's
inputs (the same mask embedding at other positions), never each other's predictions, so slot 2
guesses token a+2 without knowing slot 1's guess. On its own training data the one-layer draft's
slot 2 is right 21 % of the time but on the same chains as slot 1 only 3.5 % (5.3 % if they were
independent); with two layers 8.8 % (8.3 % independent), and 1.29 -> 1.47 at k = 3 on the same data
and steps; served 1.093 -> 1.118. On MT-Bench slot 2 alone is right 7.4-7.7 % of the time with
either draft (every start position), so what remains is data: 64 narrow conversations.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Each family's draft config and what it changes in the default recipe (Eagle3's one layer reads
# [embedding, fused hidden state], so no target layer fits it).
FAMILIES = {
    "dflash": ("recipes/draft_models/smollm2_dflash.json", []),
    "eagle3": ("recipes/draft_models/smollm2_eagle3.json", ["training.init_layers_from_target=[]"]),
}
DEFAULT_POINTS = "64:200,128:400,256:800,512:1600,1024:3200"
# The GPU ladder: conversations x steps (batch 16). Rungs past 8k conversations train one pass:
# more replays the first pass from a local spool bounded by the longest samples (16384 of up to
# 4.5 MiB is 72 GiB, more than the H200 machine's 64 GiB disk).
LADDER_POINTS = "1024:1000,4096:2048,16384:1024,32768:2048"
LADDER_OVERRIDES = [
    "data.prompts=builtin:magpie",
    "data.regenerate_tokens=512",
    "data.max_prompt_tokens=512",
    "engine.max_model_len=1280",
    # Every sample of a rung in the segment (about 2400 of the longest in 8 GB): capture never waits.
    "store.global_segment_size=64GB",
    "evaluate.sets=[mt_bench,human_eval]",
    "training.spool_max_size=40GB",
]


def parse_points(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        n, _, s = item.partition(":")
        if not (n.isdigit() and s.isdigit()) or int(n) < 1 or int(s) < 1:
            raise SystemExit(f"--points: {item!r} is not SAMPLES:STEPS (e.g. 256:800)")
        out.append((int(n), int(s)))
    return out


def run_point(
    family: str, samples: int, steps: int, out: Path, extra: list[str], recipe: str = "recipes/local.yaml"
) -> dict[str, Any]:
    """One job; its summary (read back when an earlier sweep ran it already)."""
    root = out / f"{family}-{samples}x{steps}"
    done = root / "latest" / "summary.json"
    if done.is_file():
        return json.loads(done.read_text())
    cmd = [
        sys.executable, "-m", "hpctoolkit.submit", recipe,
        f"paths.output_dir={root}", f"draft.config={FAMILIES[family][0]}", *FAMILIES[family][1],
        f"data.num_samples={samples}", f"training.steps={steps}",
        f"training.checkpoint_every={max(steps // 2, 1)}", *extra,
    ]  # fmt: skip
    t0 = time.monotonic()
    r = subprocess.run(cmd, cwd=REPO, check=False, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(
            f"{family} {samples}:{steps} failed (exit {r.returncode}): {tail}; logs under {root}"
        )
    summary = json.loads(done.read_text())
    summary.setdefault("wall_seconds", round(time.monotonic() - t0, 1))
    return summary


def row(family: str, samples: int, steps: int, s: dict[str, Any]) -> dict[str, Any]:
    return {
        "family": family,
        "samples": samples,
        "steps": steps,
        "supervised_tokens": s.get("supervised_tokens"),
        "served": s.get("served_acceptance_length"),
        "by_category": s.get("served_acceptance_by_category") or {},
        "simulated_by_trainer": s.get("acceptance_length_at_served_k", s.get("acceptance_length")),
        "wall_s": s.get("wall_seconds"),
        "train_s": s.get("train_wall_seconds"),
        # One GPU holds the whole job (the GPU default), so its GPU-seconds are its wall time.
        "gpu_s": s.get("wall_seconds") if s.get("recipe") == "local_gpu" else None,
        "per_set": {k: v.get("served_acceptance_length") for k, v in (s.get("per_set") or {}).items()},
    }


LADDER_RESULTS = REPO / "benchmarks" / "results" / "ladder.jsonl"


def _gpu_name() -> str | None:
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
    except OSError:
        return None
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def _commit() -> str | None:
    r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False)
    if r.returncode == 0:
        return r.stdout.strip()
    # A tree laid from `git archive` (benchmarks/gpu_node.sh): the commit is in the tar's header.
    stamp = REPO / ".commit"
    return stamp.read_text().strip() if stamp.is_file() else None


def ladder_row(family: str, samples: int, steps: int, s: dict[str, Any], out: Path) -> dict[str, Any]:
    """One rung as `benchmarks/results/ladder.jsonl` keeps it: small, no data or weights."""
    import datetime

    per_set = s.get("per_set") or {}
    logs = out / f"{family}-{samples}x{steps}" / "latest" / "logs"
    regen = [json.loads(p.read_text()) for p in sorted(logs.glob("regenerate-engine*.json"))]
    return {
        "family": family,
        "conversations": samples,
        "steps": steps,
        "batch_size": s.get("batch_size", 16),
        "epochs": round(steps * 16 / samples, 2),
        "supervised_tokens": s.get("supervised_tokens"),
        "k": s.get("num_speculative_tokens", 3),
        "served": {
            name: {
                "tau": v.get("served_acceptance_length"),
                "by_category": v.get("served_acceptance_by_category"),
                "by_turn": v.get("served_acceptance_by_turn"),
                "per_position": _per_position(v.get("counters") or {}),
            }
            for name, v in per_set.items()
        }
        or {"mt_bench": {"tau": s.get("served_acceptance_length")}},
        # The first set's (MT-Bench's): the run's summary keeps it under `evaluate`.
        "served_per_position": s.get("served_per_position_acceptance")
        or (s.get("evaluate") or {}).get("served_per_position_acceptance"),
        "served_by_category": s.get("served_acceptance_by_category"),
        "served_by_turn": s.get("served_acceptance_by_turn"),
        "trainer_tau_at_k": s.get("acceptance_length_at_served_k", s.get("acceptance_length")),
        "regenerated": {k: sum(int(r.get(k, 0)) for r in regen) for k in ("turns", "truncated", "degenerate")}
        if regen
        else None,
        "seconds": {
            "wall": s.get("wall_seconds"),
            "train": s.get("train_wall_seconds"),
            "phases": s.get("phases_s"),
        },
        "gpu_busy": s.get("gpu_busy"),
        "gpu_seconds": s.get("wall_seconds") if s.get("recipe") == "local_gpu" else None,
        "gpu": _gpu_name(),
        "date": datetime.date.today().isoformat(),
        "commit": _commit(),
    }


def _per_position(counters: dict[str, Any]) -> list[float] | None:
    """The share of drafts whose i-th token vLLM accepted, from the set's own spec-decode counters."""
    drafts = counters.get("vllm:spec_decode_num_drafts")
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens_per_pos")
    if not drafts or not accepted:
        return None
    return [round(a / drafts, 4) for a in accepted]


def rows_from_ladder(path: Path) -> list[dict[str, Any]]:
    """The rungs `ladder_row` recorded, as `table` and `plot` take them (the curve across sessions)."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        if not line.strip():
            continue
        r = json.loads(line)
        served = r.get("served") or {}
        head = served.get("mt_bench") or next(iter(served.values()), {})
        out.append(
            {
                "family": r["family"],
                "samples": r["conversations"],
                "steps": r["steps"],
                "supervised_tokens": r.get("supervised_tokens"),
                "served": head.get("tau"),
                "by_category": head.get("by_category") or r.get("served_by_category") or {},
                "simulated_by_trainer": r.get("trainer_tau_at_k"),
                "wall_s": (r.get("seconds") or {}).get("wall"),
                "train_s": (r.get("seconds") or {}).get("train"),
                "gpu_s": r.get("gpu_seconds"),
                "per_set": {name: v.get("tau") for name, v in served.items()},
                "gpu": r.get("gpu"),
                "date": r.get("date"),
            }
        )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "family  samples  steps  sup.tokens  served  min-max by category  trainer-sim  human_eval"
        "  train s  gpu s  wall s"
    )
    lines = [head]
    for r in rows:
        cats = list(r["by_category"].values())
        spread = f"{min(cats):.2f}-{max(cats):.2f}" if cats else "-"
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        he = (r.get("per_set") or {}).get("human_eval")
        lines.append(
            f"{r['family']:<7} {r['samples']:>7} {r['steps']:>6} {r['supervised_tokens'] or 0:>11} "
            f"{fmt(r['served']):>7} {spread:>20} {fmt(r['simulated_by_trainer']):>12} {fmt(he):>11} "
            f"{r.get('train_s') or '-':>8} {r.get('gpu_s') or '-':>6} {r['wall_s'] or 0:>7}"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, k: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    sets = sorted({name for r in rows for name in r.get("per_set") or {}}) or ["mt_bench"]
    for family in FAMILIES:
        for name in sets:
            pts = sorted(
                (r["supervised_tokens"], (r.get("per_set") or {}).get(name, r["served"]))
                for r in rows
                if r["family"] == family and r["served"]
            )
            if pts:
                label = family if len(sets) == 1 else f"{family}, {name}"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("supervised tokens trained on, over all steps (the target's own answers)")
    ax.set_ylabel(f"served acceptance length (incl. bonus, k={k})")
    ax.set_title("SmolLM2-135M-Instruct drafts served by vLLM")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--points",
        default=None,
        help=f"SAMPLES:STEPS,... (default {DEFAULT_POINTS}; --ladder: {LADDER_POINTS})",
    )
    ap.add_argument(
        "--ladder",
        action="store_true",
        help="the GPU ladder: recipes/local_gpu.yaml on builtin:magpie conversations, MT-Bench and HumanEval",
    )
    ap.add_argument("--families", default="dflash,eagle3", help="of " + ",".join(FAMILIES))
    ap.add_argument("--out", type=Path, default=REPO / "runs" / "acceptance")
    ap.add_argument("--plot", type=Path, default=None, help="default: OUT/acceptance.png")
    ap.add_argument(
        "--no-run",
        action="store_true",
        help="only read the points already run under --out (table and plot of those; the rest listed)",
    )
    ap.add_argument(
        "--record",
        type=Path,
        default=LADDER_RESULTS,
        help="--ladder: append each rung's row here (default benchmarks/results/ladder.jsonl)",
    )
    ap.add_argument("overrides", nargs="*", help="recipe overrides for every point (key=value)")
    args = ap.parse_args(argv)
    points = args.points or (LADDER_POINTS if args.ladder else DEFAULT_POINTS)
    recipe = "recipes/local_gpu.yaml" if args.ladder else "recipes/local.yaml"
    overrides = (LADDER_OVERRIDES if args.ladder else []) + list(args.overrides)
    families = args.families.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}; known: {sorted(FAMILIES)}")
    rows: list[dict[str, Any]] = []
    if args.ladder and args.no_run:
        # The ladder's curve is what `--record` kept, rung by rung, across sessions.
        rows = [r for r in rows_from_ladder(args.record) if r["family"] in families]
        if not rows:
            print(f"[acceptance] no rung recorded in {args.record} yet", flush=True)
            return 0
        families = []
    for family in families:
        for samples, steps in parse_points(points):
            if (
                args.no_run
                and not (args.out / f"{family}-{samples}x{steps}" / "latest" / "summary.json").is_file()
            ):
                print(
                    f"[acceptance] {family} {samples}:{steps} not run under {args.out}; skipped", flush=True
                )
                continue
            print(f"[acceptance] {family} {samples} samples x {steps} steps ...", flush=True)
            summary = run_point(family, samples, steps, args.out, overrides, recipe)
            rows.append(row(family, samples, steps, summary))
            if args.ladder and not args.no_run:
                # The curve grows across sessions: one row per rung run (`--no-run` draws it).
                args.record.parent.mkdir(parents=True, exist_ok=True)
                with args.record.open("a") as f:
                    f.write(json.dumps(ladder_row(family, samples, steps, summary, args.out)) + "\n")
            print(table(rows[-1:]).splitlines()[1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "acceptance.json").write_text(json.dumps(rows, indent=2) + "\n")
    k = next((o.split("=", 1)[1] for o in overrides if o.startswith("evaluate.num_speculative_tokens=")), "3")
    path = args.plot or args.out / "acceptance.png"
    plot(rows, path, k)
    print(table(rows))
    print(f"[acceptance] table in {args.out / 'acceptance.json'}, plot in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
