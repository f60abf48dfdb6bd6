"""A rehearsal of the image's %post on this machine (no apptainer, no GPU needed).

A scratch virtualenv stands in for the base image: the CUDA `vllm==0.32.0` wheel and its
dependencies from PyPI, installed as the vLLM project's image installs them (uv), on Python 3.12
as in that image when this machine has it. Then the very scripts the definition file runs:
apptainer/post.sh on a copy of what %files copies (patch series, hpctoolkit without extras, the
Mooncake wheel of the CUDA major post.sh finds, byte-compiling, build info, labels), and
apptainer/test.sh, the %test checks, none of which needs a GPU. What the image adds around them
and this cannot run: the base image itself (its system packages, CUDA compat driver, digest), and
apptainer. tests/unit/test_apptainer_def.py checks that %post and %test call these scripts.

Wheels are cached outside the repository, in $HPCTOOLKIT_CACHE (default ~/.cache/hpctoolkit):
uv's cache (vLLM and its dependencies, ~8 GB) and pip's. Measured on the 2-core machine, shared
(load average 7):
    .venv/bin/python -m pytest tests/e2e/test_apptainer_post.py        5.1 min, warm cache
    HPCTOOLKIT_CACHE=/tmp/empty .venv/bin/python -m pytest tests/e2e/test_apptainer_post.py   5.6 min
(installing vLLM: 12 s from the cache, 84 s from PyPI; post.sh 142-152 s, most of it
byte-compiling vLLM; test.sh 92-97 s, most of it importing vLLM).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEF = ROOT / "apptainer" / "hpctoolkit.def"
CACHE = Path(os.environ.get("HPCTOOLKIT_CACHE", Path.home() / ".cache" / "hpctoolkit"))
VLLM = "vllm==0.32.0"
# The interpreter of vLLM's image is 3.12; pyenv installs put one here.
PY312 = [shutil.which("python3.12"), *sorted(Path.home().glob(".pyenv/versions/3.12.*/bin/python3.12"))]

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(1800)]


def _uv() -> str:
    uv = Path(sys.executable).with_name("uv")
    if uv.exists():
        return str(uv)
    found = shutil.which("uv")
    if found is None:
        pytest.fail("uv is not installed (make setup installs it into .venv)")
    return found


def _python312() -> str | None:
    for cand in PY312:
        if cand and subprocess.run([str(cand), "-V"], capture_output=True, check=False).returncode == 0:
            return str(cand)
    return None


def _files_section() -> list[tuple[str, str]]:
    text = DEF.read_text()
    body = text.split("\n%files\n", 1)[1].split("\n%", 1)[0]
    return [tuple(line.split()) for line in body.splitlines() if line.strip()]


def _run(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> str:
    t0 = time.monotonic()
    res = subprocess.run(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )
    log.write_text(res.stdout)
    print(f"{' '.join(cmd[:3])}...: {time.monotonic() - t0:.0f} s, rc {res.returncode}")
    assert res.returncode == 0, f"{cmd} failed (log {log}):\n{res.stdout[-6000:]}"
    return res.stdout


def _py_out(py: str, code: str) -> str:
    """`py -c code`'s output, run away from the checkout (python puts the working directory first)."""
    return subprocess.check_output([py, "-c", code], text=True, cwd="/").strip()


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    """The base stand-in, then post.sh on it; returns (python, src dir, labels file, post output)."""
    work = CACHE / "rehearsal"
    work.mkdir(parents=True, exist_ok=True)
    venv = work / "base"
    shutil.rmtree(venv, ignore_errors=True)
    env = {**os.environ, "UV_CACHE_DIR": str(CACHE / "uv"), "PIP_CACHE_DIR": str(CACHE / "pip")}
    env.pop("VIRTUAL_ENV", None)
    uv = _uv()
    # The image's interpreter where this machine has one; else this one (the package supports both).
    _run(
        [uv, "venv", "-q", "--seed", "-p", _python312() or sys.executable, str(venv)],
        env,
        work / "venv.log",
        300,
    )
    py = str(venv / "bin" / "python")
    # uv hard-links from its cache; patch replaces a file rather than writing through the link.
    _run([uv, "pip", "install", "-q", "-p", py, VLLM], env, work / "vllm.log", 1200)

    # What %files copies to /opt/hpctoolkit, here under a scratch root.
    src = tmp_path_factory.mktemp("opt") / "hpctoolkit"
    src.mkdir()
    for source, dest in _files_section():
        target = src / Path(dest).relative_to("/opt/hpctoolkit")
        if (ROOT / source).is_dir():
            shutil.copytree(ROOT / source, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(ROOT / source, target)
    labels = src.parent / "labels"
    post_env = {
        **env,
        "PYTHON": py,
        "VLLM_VERSION": "0.32.0",
        "BASE_IMAGE": "rehearsal: PyPI vllm==0.32.0 in a virtualenv",
        "BASE_DIGEST": "unknown",
        "APPTAINER_LABELS": str(labels),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    out = _run(["bash", str(src / "apptainer" / "post.sh"), str(src)], post_env, work / "post.log", 1500)
    return py, src, labels, out, post_env


def test_post_patches_installs_and_records(rehearsal):
    _py, src, labels, out, _ = rehearsal
    assert re.search(r"apply_series: (\d+) applied, 0 already present", out), out
    info = json.loads((src / "build-info.json").read_text())
    series = src / "patches" / "vllm" / "v0.32.0" / "series"
    names = [
        ln.split("#", 1)[0].split()[0]
        for ln in series.read_text().splitlines()
        if ln.split("#", 1)[0].strip()
    ]
    assert [p["name"] for p in info["patches"]] == names
    assert info["vllm_version"] == "0.32.0" and info["hpctoolkit_version"] == "0.1.0"
    # The rehearsal ran on the image's Python wherever this machine has a 3.12.
    print(f"\n[measure] rehearsal on Python {info['python']}")
    assert info["python"].startswith("3.12.") or _python312() is None, info["python"]
    assert info["mooncake"] == f"mooncake-transfer-engine-cuda{info['cuda'].split('.')[0]}==0.3.13.post1" or (
        info["cuda"].startswith("12.") and info["mooncake"] == "mooncake-transfer-engine==0.3.13.post1"
    )
    text = labels.read_text()
    for p in info["patches"]:
        assert f"org.hpctoolkit.patch.{p['name']} sha256:{p['sha256']}\n" in text
    assert "org.hpctoolkit.version 0.1.0\n" in text and "org.hpctoolkit.vllm-version 0.32.0\n" in text


def test_hpctoolkit_installed_without_extras_and_base_untouched(rehearsal):
    py, _src, *_ = rehearsal
    code = (
        "import importlib.metadata as m, hpctoolkit, json\n"
        "names = {d.metadata['Name'].lower() for d in m.distributions()}\n"
        "print(json.dumps([hpctoolkit.__file__, sorted(n for n in names if 'flash' in n or 'cutlass' in n or 'tvm' in n),"
        " m.version('torch'), m.version('transformers')]))"
    )
    where, flashy, torch, transformers = json.loads(_py_out(py, code))
    assert "site-packages" in where and str(ROOT) not in where  # installed, not the checkout
    # No flash-attn: only what vLLM itself brought (flashinfer, cutlass-dsl, tvm-ffi).
    assert not [n for n in flashy if n.startswith(("flash-attn", "flash_attn"))], flashy
    assert torch.startswith("2.13.0") and transformers == "5.19.0"


def test_patched_tree_is_byte_compiled(rehearsal):
    py, src, *_ = rehearsal
    site = Path(_py_out(py, "import sysconfig; print(sysconfig.get_paths()['purelib'])"))
    patched = set()
    for patch in (src / "patches" / "vllm" / "v0.32.0").glob("*.patch"):
        patched |= set(re.findall(r"^\+\+\+ b/(vllm/\S+)", patch.read_text(), re.M))
    assert patched
    tag = _py_out(py, "import sys; print(sys.implementation.cache_tag)")
    for rel in sorted(patched):
        source = site / rel
        if not source.exists():  # the tests patch names files outside the installed tree
            continue
        pyc = source.parent / "__pycache__" / f"{source.stem}.{tag}.pyc"
        assert pyc.exists(), f"{rel} was not byte-compiled"
        _, _, mtime, size = struct.unpack("<4sIII", pyc.read_bytes()[:16])
        assert (mtime, size) == (
            int(source.stat().st_mtime) & 0xFFFFFFFF,
            source.stat().st_size & 0xFFFFFFFF,
        ), f"{pyc} is stale: compiled before the patch"


def test_image_checks_pass(rehearsal):
    _py, src, _, _, env = rehearsal
    out = _run(
        ["bash", str(src / "apptainer" / "test.sh"), str(src)], env, CACHE / "rehearsal" / "test.log", 900
    )
    assert "FAILED" not in out
    for what in (
        "supports_pp(ExtractHiddenStatesModel)",
        "KVConnectorOutput carries finished_sending",
        "selects the V1 runner",
        "Mooncake's store and engine load, linking",
    ):
        assert re.search(rf"^hpctoolkit test: ok: .*{re.escape(what)}", out, re.M), out


def test_runscript_dispatches(rehearsal):
    py, src, _, _, env = rehearsal
    script = str(src / "apptainer" / "runscript.sh")
    run_env = {**env, "HPCTOOLKIT_IMAGE_PYTHON": py, "HPCTOOLKIT_IMAGE_SRC": str(src)}
    kw = {"env": run_env, "cwd": "/", "capture_output": True, "text": True}
    info = subprocess.run(["sh", script, "build-info"], check=True, **kw)
    assert json.loads(info.stdout)["vllm_version"] == "0.32.0"
    code = "import hpctoolkit.submit, sys; print(sys.executable, hpctoolkit.submit.__file__)"
    out = subprocess.run(["sh", script, "python", "-c", code], check=True, **kw)
    exe, where = out.stdout.split()
    assert exe == py and "site-packages" in where
    bad = subprocess.run(["sh", script, "nope"], check=False, **kw)
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr and "submit RECIPE" in bad.stderr
