"""The embedded run behind `make run` (the plan's roles as processes on this machine), end to end on
real parts and shortened; `python -m hpctoolkit.status` following it; what a second run does to the
first; failures as one line."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import processes_with_env

from hpctoolkit.rundir.layout import RunDir

REPO = Path(__file__).resolve().parents[2]
SHORT = [
    "data.num_samples=12",
    "data.regenerate_tokens=32",
    "training.steps=20",
    "training.checkpoint_every=10",
    "evaluate.num_prompts=3",
    "evaluate.max_tokens=16",
]
# The watched run reports every second, so the status command sees its progress between polls.
WATCHED = [*SHORT, "training.progress_every_s=1", "evaluate.progress_every_s=1"]
PHASE_ORDER = ["start", "master", "engines", "trainers", "drain", "evaluate", "stop", "end"]


def submit(*args: str, timeout: float = 880) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpctoolkit.submit", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


def status(path: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpctoolkit.status", str(path)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


def run_watched(out: Path, log: Path) -> tuple[int, str, list[str], str | None]:
    """A local run polled with the status command every second until it ends: its exit code, its
    console, the phases status named in turn, and one report from the trainers phase with a step."""
    # Half a second a step: the trainers phase lasts long enough to be seen between two polls.
    env = {**os.environ, "HPCTOOLKIT_MIN_STEP_S": "0.5"}
    cmd = [
        sys.executable,
        "-m",
        "hpctoolkit.submit",
        "recipes/tiny.yaml",
        f"paths.output_dir={out}",
        *WATCHED,
    ]
    seen: list[str] = []
    mid = None
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            deadline = time.monotonic() + 900
            while proc.poll() is None and time.monotonic() < deadline:
                if out.is_dir() and any(out.iterdir()):
                    r = status(out)
                    assert r.returncode == 0, r.stderr
                    phase = re.search(r"^phase    (\w+)", r.stdout, re.M)
                    if phase and (not seen or seen[-1] != phase.group(1)):
                        seen.append(phase.group(1))
                    if mid is None and re.search(r"^trainer  step \d+/20", r.stdout, re.M):
                        mid = r.stdout
                time.sleep(1.0)
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode, log.read_text(), seen, mid


def error_lines(stderr: str) -> list[str]:
    return [x for x in stderr.splitlines() if x.strip()]


def role_processes(run_id: str) -> list[str]:
    """Role processes of this run still alive (they carry the run id in their environment)."""
    return processes_with_env(f"HPCTOOLKIT_RUN_ID={run_id}")


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_make_run_path_then_a_failed_second_run_keeps_the_first(tmp_path):
    out = tmp_path / "runs"
    code, text, seen, mid = run_watched(out, tmp_path / "launcher.out")
    assert code == 0, text[-4000:]
    assert "[hpctoolkit] done in" in text
    # Status followed it: the trainers phase with a step count mid-run, the phases in order, `end`.
    assert mid is not None and "phase    trainers" in mid and "FAILED" not in mid, (seen, text[-3000:])
    assert seen == sorted(seen, key=PHASE_ORDER.index), seen
    final = status(out)
    assert final.returncode == 0, final.stderr
    assert re.search(r"^phase    end: done in \d+\.\ds", final.stdout, re.M), final.stdout
    # The console: the trainer's progress lines at its interval, and rounded figures.
    steps = re.findall(r"\[hpctoolkit\.trainer\] step (\d+)/20 \(\d+%\), loss \d+\.\d{3}, ", text)
    assert steps and steps[-1] == "20" and len(steps) < 20, text[-3000:]
    assert re.search(r"final loss \d+\.\d{3};", text), text[-3000:]
    assert re.search(r"\[hpctoolkit\] done in \d+\.\ds: .* served acceptance length \d+\.\d{3} at k=3", text)
    latest = out / "latest"
    assert latest.is_symlink()
    run = RunDir.of(out, os.readlink(latest))
    s = json.loads(run.summary.read_text())
    assert s["run_id"] == run.run_id
    assert s["samples_published"] == 12
    assert s["samples_read"] == 12
    assert s["keys_left_in_store"] == 0
    assert s["bytes_moved"] > 0
    assert s["steps_trained"] == 20
    assert s["final_loss"] > 0
    assert s["acceptance_length"] >= 1.0
    assert s["served_acceptance_length"] >= 1.0
    # The command that serves the export outside hpctoolkit (run by tests/e2e/test_vllm_serve_cli.py).
    serve = shlex.split(s["serve_command"])
    assert serve[:2] == ["vllm", "serve"] and json.loads(serve[4])["model"] == str(run.export)
    assert f"serve it with vLLM: {s['serve_command']}" in text
    assert s["wall_seconds"] > 0
    # What a person looks for after a run, where the run-directory layout says it is.
    assert run.config.is_file()
    assert (run.export / "config.json").is_file()
    assert (run.train / "acceptance_per_position.png").is_file()
    assert list((run.train / "tensorboard").iterdir())
    assert list(run.checkpoints.iterdir())
    assert run.log("engine0").is_file() and run.log("trainer0").is_file()
    assert not role_processes(run.run_id)
    before = {p: p.stat().st_mtime_ns for p in run.root.rglob("*") if p.is_file()}

    # A new user's typo in the master address: one line, exit 1, and the first run untouched.
    r2 = submit("recipes/tiny.yaml", f"paths.output_dir={out}", "store.master_address=127.0.0.1:9")
    assert r2.returncode == 1, r2.stderr
    lines = error_lines(r2.stderr)
    assert len(lines) == 1 and "127.0.0.1:9" in lines[0], r2.stderr
    assert os.readlink(latest) == run.run_id
    assert sorted(out.iterdir()) == sorted([latest, run.root])
    assert {p: p.stat().st_mtime_ns for p in run.root.rglob("*") if p.is_file()} == before


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_killing_the_master_during_capture_is_one_line(tmp_path):
    out = tmp_path / "runs"
    cmd = [
        sys.executable,
        "-m",
        "hpctoolkit.submit",
        "recipes/tiny.yaml",
        f"paths.output_dir={out}",
        "data.num_samples=64",
        "data.regenerate_tokens=0",
        "engine.capture_batch=4",
        "evaluate.enabled=false",
    ]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        record = None
        while time.monotonic() < deadline:
            runs = [p for p in out.glob("tiny-*") if (p / "manifests" / "engine0.jsonl").exists()]
            if runs and (runs[0] / "manifests" / "engine0.jsonl").read_text().count("\n") >= 4:
                record = json.loads((runs[0] / "master.json").read_text())
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        assert record is not None, "the capture never started"
        port = record["address"].rpartition(":")[2]
        binary = subprocess.run(
            ["pgrep", "-f", f"mooncake_master.*--rpc_port={port}"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.split()
        assert binary, "no mooncake_master for this run"
        killed_at = time.monotonic()
        for pid in binary:
            os.kill(int(pid), signal.SIGKILL)
        _stdout, stderr = proc.communicate(timeout=300)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "Mooncake master" in lines[0] or "StoreError" in lines[0], lines[0]
    assert took < 120, f"the run took {took:.0f}s to end after the master died"
    assert not role_processes(runs[0].name)


def test_flags_and_overrides_in_any_order():
    r = submit("recipes/tiny.yaml", "--dry-run", "engine.dtype=float32", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "dry run: recipe is valid" in r.stdout
    r = submit("--dry-run", "recipes/tiny.yaml", "engine.dtype=float32", timeout=120)
    assert r.returncode == 0, r.stderr
    r = submit("recipes/tiny.yaml", "--dry-runn", timeout=120)
    assert r.returncode == 2
    assert error_lines(r.stderr) == ["error: python -m hpctoolkit.submit: unrecognized arguments: --dry-runn"]


def test_help_exits_zero_with_usage():
    r = submit("--help", timeout=120)
    assert r.returncode == 0
    assert r.stdout.startswith("usage: python -m hpctoolkit.submit")
