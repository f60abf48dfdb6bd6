"""The Apptainer definition, checked without apptainer (no binary can be had on these machines).

spython parses the file, but silently drops a section whose header is misspelt, so the raw text is
checked too: every `%section` header must be a known one, and each required one must be there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEF = ROOT / "apptainer" / "hpctoolkit.def"
SERIES = "/opt/hpctoolkit/patches/vllm/v0.32.0/series"
REQUIRED = ("labels", "files", "environment", "post", "test", "help")
# Apptainer's section names (apptainer docs, "Definition files").
KNOWN = {
    "setup", "files", "environment", "post", "runscript", "startscript", "test", "labels", "help",
    "arguments", "app", "appinstall", "appenv", "apphelp", "apprun", "applabels", "appfiles", "apptest",
}  # fmt: skip
HEADER = re.compile(r"^%(\S+)")


def raw_sections(text: str) -> dict[str, str]:
    """Section name -> body, from the raw text (what apptainer itself reads)."""
    out: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = HEADER.match(line)
        if m:
            current = m.group(1)
            if current in out:
                raise AssertionError(f"section %{current} appears twice")
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def text() -> str:
    return DEF.read_text()


@pytest.fixture(scope="module")
def recipe():
    from spython.main.parse.parsers import SingularityParser

    return SingularityParser(str(DEF)).recipe["spython-base"]


def test_header_bootstraps_a_pinned_vllm_image(text, recipe):
    head = text.split("\n%", 1)[0]
    assert re.search(r"^Bootstrap:\s*docker\s*$", head, re.M), "Bootstrap must be docker"
    assert recipe.fromHeader == "vllm/vllm-openai:v0.32.0"
    assert "latest" not in recipe.fromHeader and "nightly" not in recipe.fromHeader


def test_every_section_header_is_known_and_required_ones_exist(text):
    sections = raw_sections(text)
    unknown = sorted(set(sections) - KNOWN)
    assert not unknown, f"unknown (misspelt?) sections {unknown}: spython would drop them silently"
    for name in REQUIRED:
        assert name in sections, f"%{name} is missing"
        assert sections[name].strip(), f"%{name} is empty"


def test_files_copy_the_patches_and_the_package(recipe):
    pairs = dict(line.split() for line in recipe.files)
    assert pairs["patches"] == "/opt/hpctoolkit/patches"
    assert pairs["hpctoolkit"] == "/opt/hpctoolkit/hpctoolkit"
    for src in pairs:  # sources are relative to the repo root, where the build runs
        assert (ROOT / src).exists(), f"%files source {src} does not exist"


def test_post_applies_the_series_then_installs_hpctoolkit(recipe):
    post = "\n".join(recipe.install)
    apply_at = post.index(f'patches/apply_series.sh "$SITE" {SERIES}')
    install_at = post.index("pip install --no-cache-dir --no-deps /opt/hpctoolkit")
    assert apply_at < install_at
    assert "set -eu" in post.splitlines()[0]
    assert 'find_spec("vllm")' in post, "site-packages must be located from the installed vllm"


def test_environment_pins_the_v1_runner(recipe):
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in recipe.environ


def test_test_section_checks_patch_supports_pp_and_v1(text):
    body = raw_sections(text)["test"]
    assert "apply_series.sh --check" in body and "0 would apply, 2 already present" in body
    assert "supports_pp(ExtractHiddenStatesModel)" in body
    assert "VLLM_USE_V2_MODEL_RUNNER=0 python3" in body and "use_v2_model_runner" in body


def test_expected_patch_count_matches_the_series(text):
    series = (ROOT / "patches" / "vllm" / "v0.32.0" / "series").read_text()
    n = sum(1 for line in series.splitlines() if line.split("#", 1)[0].strip())
    assert f"0 would apply, {n} already present" in raw_sections(text)["test"]


@pytest.mark.parametrize("section", ["post", "test"])
def test_shell_sections_pass_shellcheck(text, section, tmp_path):
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (apt-get install shellcheck)")
    script = tmp_path / f"{section}.sh"
    script.write_text("#!/bin/sh\n" + raw_sections(text)[section] + "\n")
    res = subprocess.run(["shellcheck", "-s", "sh", str(script)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr
