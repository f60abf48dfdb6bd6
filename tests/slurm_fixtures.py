"""The emulated Slurm cluster (launch/local_slurm.sh) as test scaffolding shared by the real tests."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from hpctoolkit.slurm import shell

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "local_slurm.sh"
SLURM_TOOLS = ("slurmctld", "slurmd", "slurmdbd", "munged", "mysql", "sbatch", "sacct")
UNFINISHED = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING")


def why_not(extra_tools: Sequence[str] = (), modules: Sequence[tuple[str, str]] = ()) -> str | None:
    """Why the emulated cluster cannot run here (a skip reason), or None."""
    if os.geteuid() != 0:
        return "the emulated cluster runs slurmd, which needs root"
    path = f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin"
    missing = [b for b in (*SLURM_TOOLS, *extra_tools) if not shutil.which(b, path=path)]
    if missing:
        return f"Slurm packages missing ({missing}); run launch/system_deps.sh"
    for module, why in modules:
        try:
            __import__(module)
        except ImportError:
            return f"{module} is not importable: the job {why}"
    return None


@contextmanager
def emulated_cluster(state: Path, nodes: int) -> Iterator[tuple[dict[str, str], str]]:
    """Start `nodes` emulated nodes with their state under `state`; yield (script env, slurm.conf)."""
    env = {**os.environ, "HPCTOOLKIT_SLURM_STATE": str(state), "HPCTOOLKIT_SLURM_RESET": "1"}
    t0 = time.monotonic()
    shell.run(["bash", str(SCRIPT), "start", str(nodes)], env=env, timeout_s=120)
    print(f"cluster up in {time.monotonic() - t0:.1f}s")
    try:
        yield env, str(state / "etc" / "slurm.conf")
    finally:
        shell.run(["bash", str(SCRIPT), "stop"], env=env, timeout_s=60)


def wait_done(job: str, env: dict[str, str], timeout_s: float = 150, poll_s: float = 0.5) -> str:
    """Poll sacct until the job leaves PENDING/RUNNING; return its final state.

    On timeout the job is cancelled, so a stuck job never outlives its test.
    """
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        out = shell.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], env=env).strip()
        state = out.splitlines()[0].split()[0] if out else ""
        if state and state not in UNFINISHED:
            return state
        time.sleep(poll_s)
    shell.run(["scancel", job], env=env)
    raise TimeoutError(f"job {job} still {state or 'unknown'} after {timeout_s}s; cancelled")
