"""No silent skips (tests/conftest.py's `SkipLedger`): a session whose tests skip for a reason that
`EXPECTED_SKIPS` does not list fails, naming each test and its reason; under xdist too, and for a
module skipped whole at collection. Each case runs a tiny synthetic suite in a pytest subprocess
whose conftest registers the ledger with a list of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import ALLOW_SKIPS, EXPECTED_SKIPS, ROOT, ExpectedSkip, importable, is_expected

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"

SUITE_CONFTEST = f"""
import importlib.util
import os
import sys

spec = importlib.util.spec_from_file_location("suite_conftest", {str(CONFTEST)!r})
suite = sys.modules["suite_conftest"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)

EXPECTED = (
    suite.ExpectedSkip("test_x.py::test_gpu*", "needs a CUDA device", "no GPU here", lambda: True),
    suite.ExpectedSkip(
        "test_x.py::test_gated", "set GATE=1*", "gated", lambda: os.environ.get("GATE") != "1"
    ),
)


def pytest_configure(config):
    config.pluginmanager.register(suite.SkipLedger(EXPECTED), "skip-ledger")
"""

TESTS = """
import pytest


@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_gpu_one():
    pass


def test_gpu_two():
    pytest.skip("needs a CUDA device")


@pytest.mark.skipif(True, reason="set GATE=1: takes minutes")
def test_gated():
    pass


def test_runs():
    pass


@pytest.mark.xfail(reason="known")
def test_known_failure():
    raise AssertionError
"""

BROKEN = """
import pytest


def test_needs_vllm():
    pytest.skip("vLLM (the 'engine' extra) is not installed")


@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_elsewhere():
    pass
"""


def run_suite(tmp_path: Path, files: dict[str, str], *args: str, env: dict[str, str] | None = None):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # this folder is the rootdir: none of our options
    (tmp_path / "conftest.py").write_text(SUITE_CONFTEST)
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    run_env = {k: v for k, v in os.environ.items() if k not in (ALLOW_SKIPS, "GATE", "PYTEST_ADDOPTS")}
    run_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *args],
        cwd=tmp_path,
        env=run_env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_expected_skips_pass(tmp_path):
    r = run_suite(tmp_path, {"test_x.py": TESTS})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "unexpected skips" not in r.stdout


def test_an_unlisted_skip_fails_the_session_naming_the_test_and_its_reason(tmp_path):
    r = run_suite(tmp_path, {"test_x.py": TESTS, "test_y.py": BROKEN})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "0 failed" not in r.stdout
    lines = r.stdout.splitlines()
    # test_y's CUDA skip is unlisted too: the list names tests, not only reasons.
    assert "test_y.py::test_elsewhere: needs a CUDA device" in lines
    assert "test_y.py::test_needs_vllm: vLLM (the 'engine' extra) is not installed" in lines
    assert "2 unexpected skips" in r.stdout and "EXPECTED_SKIPS (tests/conftest.py)" in r.stdout
    assert not any(x.startswith("test_x.py::") for x in lines)


def test_a_listed_skip_whose_cause_does_not_hold_here_fails(tmp_path):
    r = run_suite(tmp_path, {"test_x.py": TESTS}, env={"GATE": "1"})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "test_x.py::test_gated: set GATE=1: takes minutes" in r.stdout.splitlines()


def test_a_module_skipped_at_collection_fails(tmp_path):
    gone = "import pytest\n\npytest.importorskip('no_such_module_here')\n\n\ndef test_a():\n    pass\n"
    r = run_suite(tmp_path, {"test_z.py": gone})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "test_z.py: could not import 'no_such_module_here'" in r.stdout


def test_the_variable_lets_a_local_run_pass_and_still_lists_them(tmp_path):
    r = run_suite(tmp_path, {"test_x.py": TESTS, "test_y.py": BROKEN}, env={ALLOW_SKIPS: "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"2 unexpected skips (let pass: {ALLOW_SKIPS}=1)" in r.stdout
    assert "test_y.py::test_needs_vllm: vLLM (the 'engine' extra) is not installed" in r.stdout


def test_a_real_failure_keeps_its_exit_status(tmp_path):
    failing = "def test_f():\n    assert False\n"
    r = run_suite(tmp_path, {"test_y.py": BROKEN, "test_f.py": failing})
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 failed" in r.stdout and "2 unexpected skips" in r.stdout


def test_under_xdist_the_controller_judges_every_workers_skips(tmp_path):
    r = run_suite(tmp_path, {"test_x.py": TESTS, "test_y.py": BROKEN}, "-n", "2")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "test_y.py::test_elsewhere: needs a CUDA device" in lines
    assert "test_y.py::test_needs_vllm: vLLM (the 'engine' extra) is not installed" in lines
    assert r.stdout.count("unexpected skips") == 1  # once, by the controller


# -- the suite's own list --------------------------------------------------------------------------


def test_every_entry_names_test_files_that_exist():
    for e in EXPECTED_SKIPS:
        pattern = e.tests.split("::", 1)[0]
        assert list(ROOT.glob(pattern)), f"{e.tests}: no such test file"
        assert e.why and e.reason


def test_the_gpu_tier_skips_only_for_its_listed_reasons():
    def gpu(holds: bool) -> list[ExpectedSkip]:
        return [ExpectedSkip("tests/gpu/*", "needs a CUDA device", "no GPU", lambda: holds)]

    assert is_expected("tests/gpu/test_models_gpu.py::test_a", "needs a CUDA device", gpu(True))
    assert not is_expected("tests/gpu/test_models_gpu.py::test_a", "needs a CUDA device", gpu(False))
    # A gpu-marked test of the CPU suite runs here: its skip is never the GPU tier's.
    assert not is_expected("tests/e2e/test_backpressure.py::test_a", "needs a CUDA device", gpu(True))
    assert not is_expected("tests/gpu/test_models_gpu.py::test_a", "mooncake is not installed", gpu(True))


@pytest.mark.parametrize(
    ("nodeid", "reason"),
    [
        ("tests/e2e/test_store_master.py::test_a", "mooncake (the 'engine' extra) is not installed"),
        ("tests/unit/test_engine_connector.py", "could not import 'vllm': No module named 'vllm'"),
        ("tests/e2e/test_data_synth.py::test_pre_query_on_smollm2s_template", "SmolLM2 is not converted"),
        ("tests/e2e/test_multihost.py::test_a", "the emulated cluster runs slurmd, which needs root"),
    ],
)
def test_a_broken_install_is_never_an_expected_skip(nodeid, reason):
    assert not is_expected(nodeid, reason)


# -- importable ------------------------------------------------------------------------------------


def test_importable_is_false_only_for_a_package_not_installed(tmp_path, monkeypatch):
    broken = tmp_path / "broken_pkg_for_the_test"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        "raise ImportError('libibverbs.so.1: cannot open shared object file')\n"
    )
    inner = tmp_path / "inner_missing_for_the_test"
    inner.mkdir()
    (inner / "__init__.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert importable("json")
    assert not importable("no_such_package_here.store")
    with pytest.raises(ImportError, match="libibverbs"):
        importable("broken_pkg_for_the_test")
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_here"):
        importable("inner_missing_for_the_test")
