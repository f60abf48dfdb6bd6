"""`python -m hpctoolkit.status` on a real embedded run while it runs: the trainers phase with a
step count mid-run, `end` once it finished; and what the launcher's terminal showed meanwhile
(the trainer's progress lines, rounded figures on the last line)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHORT = [
    "data.num_samples=12",
    "data.regenerate_tokens=32",
    "training.steps=20",
    "training.checkpoint_every=10",
    "training.progress_every_s=1",
    "evaluate.num_prompts=3",
    "evaluate.max_tokens=16",
    "evaluate.progress_every_s=1",
]


def status(path: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpctoolkit.status", str(path)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_status_follows_a_running_embedded_run_to_its_end(tmp_path):
    out = tmp_path / "runs"
    log = tmp_path / "launcher.out"
    # Half a second a step: the trainers phase lasts long enough to be seen between two polls.
    env = {**os.environ, "HPCTOOLKIT_MIN_STEP_S": "0.5"}
    cmd = [sys.executable, "-m", "hpctoolkit.submit", "recipes/tiny.yaml", f"paths.output_dir={out}", *SHORT]
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, text=True, env=env)
        try:
            seen: list[str] = []
            mid = None
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
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert mid is not None and "phase    trainers" in mid, (seen, text[-3000:])
    assert "FAILED" not in mid
    final = status(out)
    assert final.returncode == 0 and re.search(r"^phase    end: done in \d+\.\ds", final.stdout, re.M), (
        final.stdout
    )
    # The phases came in the lifecycle's order.
    order = ["start", "master", "engines", "trainers", "drain", "evaluate", "stop", "end"]
    assert seen == sorted(seen, key=order.index), seen
    # The terminal: the trainer's progress lines at its interval, and rounded figures.
    steps = re.findall(r"\[hpctoolkit\.trainer\] step (\d+)/20 \(\d+%\), loss \d+\.\d{3}, ", text)
    assert steps and steps[-1] == "20" and len(steps) < 20, text[-3000:]
    assert re.search(r"final loss \d+\.\d{3};", text), text[-3000:]
    assert re.search(r"\[hpctoolkit\] done in \d+\.\ds: .* served acceptance length \d+\.\d{3} at k=3", text)
    print(mid)
    print(final.stdout)
