"""Engine scenarios run in their own Python process, one vLLM engine each.

vLLM does not release its workers (nor its in-process distributed state) within a process, so
each real engine test starts `python tests/engine_helpers.py SCENARIO ARGS_JSON`; the scenario
writes its result as JSON to `ARGS["result"]`. The parent test launches the Mooncake master,
reads the samples back through the production dataset and asserts.
"""

from __future__ import annotations

import faulthandler
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DRAINED = "drained"


class _ClearableMemoryStore:
    """Process-wide in-memory store for connector unit tests (see `memory_store_factory`)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        from hpctoolkit.store.memory import MemoryStore

        self._inner = MemoryStore()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_inner":
            object.__setattr__(self, name, value)
        else:
            setattr(self._inner, name, value)


MEMORY_STORE = _ClearableMemoryStore()


def memory_store_factory(address: str | None, cfg: Any, role: str) -> Any:
    """`store_factory` for the connector in unit tests: everyone shares `MEMORY_STORE`."""
    return MEMORY_STORE


def spawn(scenario: str, args: dict[str, Any], log_path: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    log = open(log_path, "w")  # noqa: SIM115  (the child owns it for its lifetime)
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), scenario, json.dumps(args)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=str(REPO),
    )


def finish(proc: subprocess.Popen, result_path: Path, log_path: Path, timeout_s: float) -> dict[str, Any]:
    """Wait for the scenario; return its result, or fail with the tail of its log."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"scenario timed out after {timeout_s}s; log tail:\n{tail(log_path)}") from None
    if not result_path.exists():
        raise AssertionError(
            f"scenario exited {proc.returncode} without a result; log tail:\n{tail(log_path)}"
        )
    return json.loads(result_path.read_text())


def tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "<no log>"


def _children() -> list[int]:
    import psutil

    return [p.pid for p in psutil.Process().children(recursive=True) if p.is_running()]


def _engine(args: dict[str, Any]):
    from hpctoolkit.engine.config import EngineConfig
    from hpctoolkit.engine.engine import CaptureEngine
    from hpctoolkit.store.config import StoreConfig

    cfg = EngineConfig(**args["engine"])
    return CaptureEngine(
        cfg, args["model_dir"], args["address"], StoreConfig(**args.get("store", {})), args["run_id"]
    )


def scenario_capture(args: dict[str, Any]) -> dict[str, Any]:
    """Capture the prompts, append each manifest to `manifests` as it comes, wait for the reader."""
    work = Path(args["workdir"])
    before = _children()
    t0 = time.monotonic()
    eng = _engine(args)
    started = time.monotonic() - t0
    children_running = [p for p in _children() if p not in before]
    with (work / "manifests.jsonl").open("a") as f:
        for ids in args["prompts"]:
            (m,) = eng.capture([ids])
            f.write(m.to_json() + "\n")
            f.flush()
    # Published fragments live in this process's store segment: wait until the reader is done.
    deadline = time.monotonic() + args.get("drain_timeout_s", 120)
    while not (work / DRAINED).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    t1 = time.monotonic()
    eng.shutdown()
    return {
        "engine_start_s": started,
        "shutdown_s": time.monotonic() - t1,
        "children_while_running": len(children_running),
        "children_after_shutdown": [p for p in _children() if p not in before],
        "reaped_by_us": eng.reaped,
        "drained": (work / DRAINED).exists(),
    }


def scenario_master_killed(args: dict[str, Any]) -> dict[str, Any]:
    """Capture continuously; kill the master mid-run; time how long until capture() raises."""
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake_master import launch_master

    master = launch_master(StoreConfig(), Path(args["workdir"]) / "master-logs")
    args = dict(args, address=master.address)
    before = _children()
    eng = _engine(args)
    children_running = [p for p in _children() if p not in before]
    done = 0
    killed_at: list[float] = []
    ok_before = eng.capture([args["prompts"][0]])  # the path works while the master is up
    done += len(ok_before)

    def kill() -> None:
        time.sleep(args.get("kill_after_s", 1.0))
        # Before the kill: the capture may fail (and read this) before `kill()` has returned.
        killed_at.append(time.monotonic())
        master.kill()

    threading.Thread(target=kill, daemon=True).start()
    result: dict[str, Any] = {"error_type": None}
    deadline = time.monotonic() + args.get("give_up_s", 120)
    try:
        while time.monotonic() < deadline:
            eng.capture([args["prompts"][done % len(args["prompts"])]])
            done += 1
    except Exception as err:
        now = time.monotonic()
        result = {
            "error_type": type(err).__name__,
            "error_mro": [c.__name__ for c in type(err).__mro__],
            "message": str(err),
            "seconds_after_kill": now - killed_at[0] if killed_at else None,
        }
    result["captured_before_error"] = done
    t1 = time.monotonic()
    eng.shutdown()
    result["shutdown_s"] = time.monotonic() - t1
    result["children_while_running"] = len(children_running)
    result["children_after_shutdown"] = [p for p in _children() if p not in before]
    result["reaped_by_us"] = eng.reaped
    master.stop()
    return result


def scenario_abort(args: dict[str, Any]) -> dict[str, Any]:
    """A request aborted part-way through its prefill, then an ordinary capture: the store's keys.

    The long prompt is added to vLLM's engine directly and stepped once (its first prefill chunk
    runs, so the connector has rows of it), then aborted; the engine steps on until it has nothing
    left. The capture after it proves the engine still works and names the only sample that may be
    in the store."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from hpctoolkit.store.probe import list_keys_via_master

    eng = _engine(args)
    engine = eng._llm.llm_engine
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    long, short = args["prompts"]
    engine.add_request("aborted-request", TokensPrompt(prompt_token_ids=long), params)
    steps = 0
    for _ in range(args.get("steps_before_abort", 1)):
        engine.step()
        steps += 1
    engine.abort_request(["aborted-request"])
    while engine.has_unfinished_requests() and steps < 50:
        engine.step()
        steps += 1
    (m,) = eng.capture([short])
    time.sleep(args.get("settle_s", 2.0))  # a late publish would land by now
    keys = list_keys_via_master(args["metrics_address"])
    eng.shutdown()
    named = sorted(f.key for f in m.all_objects)  # input_ids, fragments, loss mask, per-stage sums
    return {"keys": keys, "captured_keys": named, "steps": steps}


SCENARIOS = {"capture": scenario_capture, "master_killed": scenario_master_killed, "abort": scenario_abort}


def main() -> int:
    name, raw = sys.argv[1], sys.argv[2]
    args = json.loads(raw)
    # A scenario that hangs leaves every thread's stack in its log before the test kills it.
    faulthandler.dump_traceback_later(args.get("dump_stacks_after_s", 200), exit=False)
    try:
        result = SCENARIOS[name](args)
    except BaseException as err:
        result = {"crashed": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    Path(args["result"]).write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
