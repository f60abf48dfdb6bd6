"""The wheelhouse pinned by content (issue 44, item 4): each pin of the lock carries its wheel's sha256.

A tampered or substituted wheel, a missing wheel and a pin without its hash are refused, each named,
by the lock parser, the checker (`make wheelhouse`) and the installer; only an explicit refresh
rewrites the hashes, printing the diff. Synthetic tiny wheels in tmp dirs, as test_wheelhouse.py.
"""

from __future__ import annotations

import ast
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from test_wheelhouse import (
    LOCK,
    ROOT,
    SYNTH_LOCK,
    fake_installation,
    install,
    make_wheel,
    synth,
    synth_lock,
    with_hashes,
)

from hpctoolkit.deploy import hashes
from hpctoolkit.deploy import wheelhouse as wh
from hpctoolkit.deploy.lock import parse_lock
from hpctoolkit.errors import ConfigError

HASHES_PY = ROOT / "hpctoolkit" / "deploy" / "hashes.py"
A = "a" * 64
REFRESH = "(`make wheelhouse-lock-refresh` records it, for review)"


def tamper(wheel: Path) -> None:
    """Change a wheel's bytes in place, its name kept (a zip with bytes appended still opens)."""
    with wheel.open("ab") as f:
        f.write(b"tampered")


# ---- the lock ---------------------------------------------------------------------------------


def test_committed_lock_pins_every_wheel_by_its_sha256():
    text = LOCK.read_text()
    lock = parse_lock(text, str(LOCK))  # strict: a pin without its hash would raise
    assert all(pin.sha256 and len(pin.sha256) == 64 for pin in lock.pins.values())
    # The installer's standard-library reader sees the same pins and hashes.
    entries, problems = hashes.read_entries(text, str(LOCK))
    assert problems == []
    assert {n: e.sha256 for n, e in entries.items()} == {n: p.sha256 for n, p in lock.pins.items()}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("a==1\n", f"L:1: a==1 has no --hash=sha256:HEX; a pin without its hash is refused {REFRESH}"),
        ("a==1 --hash=sha256:xyz\n", "L:1: '--hash=sha256:xyz' is not --hash=sha256:HEX (64 lowercase hex"),
        (f"a==1 --hash=md5:{A}\n", f"L:1: '--hash=md5:{A}' is not --hash=sha256:HEX"),
        (f"a==1 --hash=sha256:{A.upper()}\n", "L:1: '--hash=sha256:AAAA"),
        (f"a==1 --hash=sha256:{A} --hash=sha256:{A}\n", "L:1: 2 hashes: a pin names its one wheel's sha256"),
        (f"a==1 --hash=sha256:{A} b==2\n", "L:1: 'a==1 --hash=sha256:"),
    ],
)
def test_lock_refuses_a_pin_without_a_well_formed_hash(text, message):
    with pytest.raises(ConfigError) as err:
        parse_lock(text, "L")
    assert str(err.value).startswith(message)
    # The installer's reader refuses the same lines.
    entries, problems = hashes.read_entries(text, "L")
    assert problems or all(e.sha256 is None for e in entries.values())


def test_a_refresh_reads_pins_without_their_hash():
    lock = parse_lock(f"a==1\nb==2 --hash=sha256:{A}\n", "L", require_hashes=False)
    assert lock.pins["a"].sha256 is None and lock.pins["b"].sha256 == A


# ---- the checker (`make wheelhouse`) ----------------------------------------------------------


def test_tampered_wheel_is_refused_naming_it(tmp_path):
    _, folder = synth(tmp_path)
    lock = synth_lock(folder)
    wheel = folder / "beta-2.0-py3-none-any.whl"
    tamper(wheel)
    report = wh.check_wheelhouse(lock, wh.read_wheelhouse(folder))
    assert len(report.problems) == 1
    problem = report.problems[0]
    actual, expected = hashes.sha256_file(wheel), lock.pins["beta"].sha256
    assert problem.startswith(
        f"beta-2.0-py3-none-any.whl: sha256 {actual[:16]}..., but L:3 pins beta==2.0 "
        f"--hash=sha256:{expected[:16]}...: a tampered or substituted wheel is refused; remove it"
    )
    assert report.tampered == ["beta-2.0-py3-none-any.whl"]
    assert report.stale == [] and report.missing == []  # kept for review, not deleted nor fetched over


def test_substituted_wheel_is_refused_naming_it(tmp_path):
    _, folder = synth(tmp_path)
    lock = synth_lock(folder)
    make_wheel(folder, "alpha", "1.0", ("beta>=2", "numpy"), files={"alpha/evil.py": "x = 1\n"})
    report = wh.check_wheelhouse(lock, wh.read_wheelhouse(folder))
    assert [p.split(":")[0] for p in report.problems] == ["alpha-1.0-py3-none-any.whl"]
    assert "a tampered or substituted wheel is refused" in report.problems[0]


def test_missing_wheel_is_named(tmp_path):
    _, folder = synth(tmp_path)
    lock = synth_lock(folder)
    (folder / "beta-2.0-py3-none-any.whl").unlink()
    report = wh.check_wheelhouse(lock, wh.read_wheelhouse(folder))
    assert report.problems == ["missing: beta==2.0 (L:3); `make wheelhouse` downloads it"]


def unhash(text: str, name: str) -> str:
    """`text` with the hash of `name`'s pin taken off (a pin added by hand, not yet refreshed)."""
    return "".join(
        line.split()[0] + "\n" if line.startswith(f"{name}==") else line + "\n" for line in text.splitlines()
    )


def series_lock(tmp_path: Path, folder: Path, text: str) -> tuple[Path, list[str]]:
    """The lock in a series folder beside a pyproject.toml, and the CLI's arguments for it."""
    series = tmp_path / "patches" / "vllm" / "v0.32.0"
    series.mkdir(parents=True, exist_ok=True)
    lock = series / "wheelhouse.lock"
    lock.write_text(text)
    (tmp_path / "pyproject.toml").write_text("[project]\ndependencies = []\n")
    return lock, ["--lock", str(lock), "--wheelhouse", str(folder)]


def test_cli_refuses_a_lock_entry_without_a_hash(tmp_path, capsys):
    _, folder = synth(tmp_path)
    lock, args = series_lock(tmp_path, folder, unhash(with_hashes(SYNTH_LOCK, folder), "beta"))
    for command in ("check", "missing"):  # `make wheelhouse` stops at `missing`, before any download
        with pytest.raises(ConfigError) as err:
            wh.main([command, *args])
        assert str(err.value) == (
            f"{lock}:3: beta==2.0 has no --hash=sha256:HEX; a pin without its hash is refused {REFRESH}"
        )
    # A refresh's download list reads it (bare lines: pip then has no hash to check them against).
    (folder / "beta-2.0-py3-none-any.whl").unlink()
    assert wh.main(["missing", "--refresh", *args]) == 0
    assert capsys.readouterr().out == "beta==2.0\n"


def test_cli_check_names_a_tampered_wheel(tmp_path, capsys):
    _, folder = synth(tmp_path)
    _, args = series_lock(tmp_path, folder, with_hashes(SYNTH_LOCK, folder))
    assert wh.main(["check", *args]) == 0
    assert "each wheel's sha256 its pin's" in capsys.readouterr().out
    tamper(folder / "vllm-0.32.0-py3-none-any.whl")
    assert wh.main(["check", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("vllm-0.32.0-py3-none-any.whl: sha256 ")
    # `missing` and `stale` go by name and version: the wheel is neither fetched over nor removed.
    assert wh.main(["missing", *args]) == 0 and wh.main(["stale", *args]) == 0
    assert capsys.readouterr().out == ""


# ---- the refresh (`make wheelhouse-lock-refresh`) ---------------------------------------------


def test_refresh_records_the_hashes_and_prints_the_diff(tmp_path, capsys):
    _, folder = synth(tmp_path)
    good = with_hashes(SYNTH_LOCK, folder)
    tamper(folder / "alpha-1.0-py3-none-any.whl")  # say, a new build of the same version
    lock, args = series_lock(tmp_path, folder, unhash(good, "beta"))
    assert wh.main(["refresh", *args]) == 0
    out = capsys.readouterr().out
    new = lock.read_text()
    assert new == with_hashes(SYNTH_LOCK, folder)  # comments and order kept; only the hashes moved
    alpha = hashes.sha256_file(folder / "alpha-1.0-py3-none-any.whl")
    changed = [line for line in out.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")]
    assert changed == [
        next(line for line in ("-" + x for x in good.splitlines()) if line.startswith("-alpha")),
        "-beta==2.0",
        f"+alpha==1.0 --hash=sha256:{alpha}",
        next("+" + x for x in new.splitlines() if x.startswith("beta")),
    ]
    assert out.splitlines()[-1].endswith(
        "2 pin lines refreshed (the diff above); review it before committing"
    )
    assert wh.main(["check", *args]) == 0
    assert wh.main(["refresh", *args]) == 0
    assert "nothing to refresh" in capsys.readouterr().out
    assert lock.read_text() == new


def test_refresh_refuses_while_a_wheel_is_missing(tmp_path, capsys):
    _, folder = synth(tmp_path)
    text = unhash(with_hashes(SYNTH_LOCK, folder), "beta")
    (folder / "beta-2.0-py3-none-any.whl").unlink()
    lock, args = series_lock(tmp_path, folder, text)
    assert wh.main(["refresh", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"missing: beta==2.0 ({lock}:3); `make wheelhouse` downloads it",
        f"{lock}: not refreshed: the folder {folder} does not hold the lock's wheels",
    ]
    assert lock.read_text() == text


# ---- the installer ----------------------------------------------------------------------------


def test_hashes_py_needs_only_the_standard_library():
    tree = ast.parse(HASHES_PY.read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported - {"__future__"} <= set(sys.stdlib_module_names)


def installed(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A fake wheelhouse folder with hpctoolkit's own (unpinned) wheel beside the pins, its series, a venv."""
    house, _, series = fake_installation(tmp_path)
    make_wheel(house, "hpctoolkit", "0.1.0", files={"hpctoolkit_marker.py": "OWN = True\n"})
    return house, series, tmp_path / "venv"


def test_installer_installs_the_pinned_wheels_and_its_own(tmp_path):
    house, series, venv = installed(tmp_path)
    done = install("--isolated", "--series", series, house, venv)
    assert done.returncode == 0, done.stderr
    assert (
        f"install_wheelhouse: the 2 pinned wheels have the sha256 that {series.parent / 'wheelhouse.lock'}"
        in (done.stdout)
    )
    assert (venv / "wheelhouse-site" / "hpctoolkit_marker.py").is_file()
    lines = (venv / "wheelhouse-hashes.txt").read_text().splitlines()
    assert [line.split()[0].rsplit("/", 1)[1] for line in lines] == [
        "torch-2.13.0-py3-none-any.whl",
        "vllm-0.32.0-py3-none-any.whl",
    ]


@pytest.mark.parametrize("how", ["tampered", "substituted"])
def test_installer_refuses_a_tampered_wheel_naming_it(tmp_path, how):
    house, series, venv = installed(tmp_path)
    wheel = house / "torch-2.13.0-py3-none-any.whl"
    if how == "tampered":
        tamper(wheel)
    else:
        make_wheel(
            house, "torch", "2.13.0", files={"torch/__init__.py": "__version__ = '2.13.0'\nEVIL = 1\n"}
        )
    done = install("--isolated", "--series", series, house, venv)
    assert done.returncode == 1
    err = done.stderr.splitlines()
    assert err[0].startswith(
        f"torch-2.13.0-py3-none-any.whl: sha256 {hashes.sha256_file(wheel)[:16]}..., but "
    )
    assert "a tampered or substituted wheel is refused" in err[0]
    assert err[1] == (
        f"install_wheelhouse: the wheels of {house} do not match {series.parent / 'wheelhouse.lock'} "
        "(above): refused, nothing installed"
    )
    assert not (venv / "wheelhouse-site").exists()


def test_installer_refuses_a_missing_wheel(tmp_path):
    house, series, venv = installed(tmp_path)
    (house / "torch-2.13.0-py3-none-any.whl").unlink()
    done = install("--isolated", "--series", series, house, venv)
    assert done.returncode == 1
    lock = series.parent / "wheelhouse.lock"
    assert done.stderr.splitlines()[0] == f"missing: torch==2.13.0 ({lock}:1): no wheel of it was given"
    assert not (venv / "wheelhouse-site").exists()


def test_installer_refuses_a_lock_entry_without_a_hash_and_an_unpinned_wheel(tmp_path):
    house, series, venv = installed(tmp_path)
    lock = series.parent / "wheelhouse.lock"
    lock.write_text(unhash(lock.read_text(), "torch"))
    make_wheel(house, "stowaway", "1.0")
    done = install("--isolated", "--series", series, house, venv)
    assert done.returncode == 1
    assert done.stderr.splitlines()[:2] == [
        f"{lock}:1: torch==2.13.0 has no --hash=sha256:HEX; a pin without its hash is refused {REFRESH}",
        f"stowaway-1.0-py3-none-any.whl: {lock} pins no stowaway; refused",
    ]
    assert not (venv / "wheelhouse-site").exists()


def test_hashes_py_runs_isolated_as_the_installer_runs_it(tmp_path):
    house, series, _ = installed(tmp_path)
    wheels = sorted(house.glob("*.whl"))
    done = subprocess.run(
        [sys.executable, "-I", str(HASHES_PY), str(series.parent / "wheelhouse.lock"), *map(str, wheels)],
        capture_output=True, text=True, cwd="/", check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    torch = house / "torch-2.13.0-py3-none-any.whl"
    digest = hashlib.sha256(torch.read_bytes()).hexdigest()
    assert f"{torch.resolve().as_uri()} --hash=sha256:{digest}" in done.stdout.splitlines()
