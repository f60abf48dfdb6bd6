"""The Apptainer definition, checked without apptainer (no binary can be had on these machines).

spython parses the file, but silently drops a section whose header is misspelt, so the raw text is
checked too: every `%section` header must be a known one, and each required one must be there.
The steps themselves live in apptainer/post.sh, test.sh and runscript.sh, which the rehearsal
(tests/e2e/test_apptainer_post.py) runs; here: that the definition runs exactly those, with its build
arguments, and that `make image`, the launchers and the recipe agree on one image path.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from hpctoolkit.slurm.container import DEFAULT_IMAGE, IMAGE_ROOTS

ROOT = Path(__file__).resolve().parents[2]
APPTAINER = ROOT / "apptainer"
DEF = APPTAINER / "hpctoolkit.def"
SRC = "/opt/hpctoolkit"
REQUIRED = ("arguments", "labels", "files", "environment", "post", "test", "runscript", "help")
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
def sections(text) -> dict[str, str]:
    return raw_sections(text)


@pytest.fixture(scope="module")
def arguments(sections) -> dict[str, str]:
    pairs = [line.strip().split("=", 1) for line in sections["arguments"].splitlines() if line.strip()]
    return dict(pairs)


@pytest.fixture(scope="module")
def recipe():
    from spython.main.parse.parsers import SingularityParser

    return SingularityParser(str(DEF)).recipe["spython-base"]


def test_header_bootstraps_the_release_image_named_by_a_build_argument(text, arguments):
    head = text.split("\n%", 1)[0]
    assert re.search(r"^Bootstrap:\s*docker\s*$", head, re.M), "Bootstrap must be docker"
    assert re.search(r"^From:\s*\{\{ BASE \}\}\s*$", head, re.M)
    assert arguments["VLLM_VERSION"] == "0.32.0"
    assert arguments["BASE"] == f"vllm/vllm-openai:v{arguments['VLLM_VERSION']}"
    assert arguments["BASE_DIGEST"] == "unknown"
    assert (ROOT / "patches" / "vllm" / f"v{arguments['VLLM_VERSION']}" / "series").is_file()


@pytest.mark.xfail(
    strict=True,
    reason=(
        "issue 44 item 4: the base's digest is not recorded yet (no registry was reachable where the "
        "wheelhouse hashes were; `skopeo inspect --format '{{.Digest}}' docker://vllm/vllm-openai:v0.32.0`"
        " gives it). Record it as BASE and BASE_DIGEST, keep the tag in a comment, make `make image` "
        "default to it, update the test above and drop this mark"
    ),
)
def test_base_is_pinned_by_digest_with_the_tag_as_a_comment(text, arguments):
    m = re.fullmatch(r"vllm/vllm-openai@(sha256:[0-9a-f]{64})", arguments["BASE"])
    assert m, f"BASE={arguments['BASE']} is not pinned by digest"
    assert arguments["BASE_DIGEST"] == m.group(1)
    tag = f"vllm/vllm-openai:v{arguments['VLLM_VERSION']}"
    assert re.search(rf"^\s*#.*{re.escape(tag)}", text, re.M), f"the tag {tag} is not kept as a comment"


def test_every_template_variable_has_a_default(text, arguments):
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", text))
    assert used and used <= set(arguments), f"undefined build arguments {sorted(used - set(arguments))}"


def test_every_section_header_is_known_and_required_ones_exist(sections):
    unknown = sorted(set(sections) - KNOWN)
    assert not unknown, f"unknown (misspelt?) sections {unknown}: spython would drop them silently"
    for name in REQUIRED:
        assert name in sections, f"%{name} is missing"
        assert sections[name].strip(), f"%{name} is empty"


def test_files_copy_the_scripts_patches_package_and_recipes(recipe):
    pairs = dict(line.split() for line in recipe.files)
    for src in ("apptainer", "patches", "hpctoolkit", "recipes", "pyproject.toml"):
        assert pairs[src] == f"{SRC}/{src}"
    for src in pairs:  # sources are relative to the repo root, where the build runs
        assert (ROOT / src).exists(), f"%files source {src} does not exist"
    assert SRC in IMAGE_ROOTS  # what the launchers never bind over


def test_post_runs_post_sh_with_the_build_arguments(sections):
    post = sections["post"]
    assert post.strip().splitlines()[0] == "set -eu"
    call = " ".join(
        line.strip().rstrip("\\") for line in post.splitlines() if not line.strip().startswith("#")
    )
    assert f"bash {SRC}/apptainer/post.sh {SRC}" in call
    for var, arg in (
        ("VLLM_VERSION", "VLLM_VERSION"),
        ("BASE_IMAGE", "BASE"),
        ("BASE_DIGEST", "BASE_DIGEST"),
    ):
        assert f"{var}='{{{{ {arg} }}}}'" in call
    assert "PYTHON=python3" in call and "PIP_NO_CACHE_DIR=1" in call


def test_post_sh_patches_then_installs_without_extras_then_compiles():
    post = (APPTAINER / "post.sh").read_text()
    code = "\n".join(line for line in post.splitlines() if not line.lstrip().startswith("#"))
    apply_at = code.index('patches/apply_series.sh" "$site" "$series"')
    install_at = code.index('pip install -q --no-deps --no-build-isolation "$src"\n')  # no [extra]
    mooncake_at = code.index('pip install -q -c "$work/base.txt" "$mooncake==$mooncake_version"')
    compile_at = code.index("-m compileall")
    assert apply_at < install_at < mooncake_at < compile_at < code.index("json.dump(info")
    assert 'find_spec("vllm")' in code, "site-packages must be located from the installed vllm"
    # Why no flash-attention extra, in the script itself.
    assert "flash-attn-4 pins nvidia-cutlass-dsl" in post and "apache-tvm-ffi" in post
    # The Mooncake wheel follows the CUDA major of the base's torch, not a fixed name.
    assert "torch.version.cuda" in code
    assert '12) mooncake="mooncake-transfer-engine"' in code
    assert '13) mooncake="mooncake-transfer-engine-cuda13"' in code
    # The base's own packages must not move.
    assert "the install changed packages the base ships" in code


def test_environment_pins_the_v1_runner(recipe):
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in recipe.environ


def test_labels_name_base_digest_and_version(sections):
    labels = dict(line.strip().split(None, 1) for line in sections["labels"].splitlines() if line.strip())
    assert labels["org.opencontainers.image.base.name"] == "{{ BASE }}"
    assert labels["org.opencontainers.image.base.digest"] == "{{ BASE_DIGEST }}"
    assert labels["vllm.version"] == "{{ VLLM_VERSION }}"
    post = (APPTAINER / "post.sh").read_text()
    assert "APPTAINER_LABELS" in post and "org.hpctoolkit.patch." in post  # each patch's sha256


def test_test_section_runs_test_sh_which_counts_the_series(sections):
    assert f"bash {SRC}/apptainer/test.sh {SRC}" in sections["test"]
    body = (APPTAINER / "test.sh").read_text()
    assert 'apply_series.sh" --check' in body and '0 would apply, $n already present"' in body
    for check in (
        "supports_pp(ExtractHiddenStatesModel)",
        '"finished_sending"',
        '"kv_connector_output"',
        '"kv_transfer_params"',
        "use_v2_model_runner",
        "libcudart",
    ):
        assert check in body, check


def test_runscript_dispatches_to_modules_that_exist(sections):
    assert f"{SRC}/apptainer/runscript.sh" in sections["runscript"]
    script = (APPTAINER / "runscript.sh").read_text()
    modules = re.findall(r'exec "\$PY" -m (\S+)', script)
    assert {"hpctoolkit.submit", "hpctoolkit.roles"} <= set(modules)
    for mod in modules:
        path = ROOT / Path(*mod.split("."))
        assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), f"{mod} does not exist"


@pytest.mark.parametrize("section", ["post", "test", "runscript"])
def test_shell_sections_pass_shellcheck(sections, section, tmp_path):
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (apt-get install shellcheck)")
    script = tmp_path / f"{section}.sh"
    script.write_text("#!/bin/sh\n" + sections[section] + "\n")
    res = subprocess.run(["shellcheck", "-s", "sh", str(script)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("name", ["post.sh", "test.sh", "runscript.sh"])
def test_scripts_pass_shellcheck(name):
    if shutil.which("shellcheck") is None:
        pytest.fail("shellcheck is not installed (apt-get install shellcheck)")
    res = subprocess.run(["shellcheck", str(APPTAINER / name)], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stdout + res.stderr


def _make_image(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "--no-print-directory", "-n", "image", "APPTAINER=true", "BASE_DIGEST=unknown", *args],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip


def test_make_image_writes_the_image_the_launchers_use():
    out = _make_image()
    assert out.returncode == 0, out.stderr
    build = " ".join(out.stdout.replace("\\\n", " ").split())
    m = re.search(r"true build (.*) (\S+) apptainer/hpctoolkit\.def", build)
    assert m, out.stdout
    assert m.group(2) == DEFAULT_IMAGE
    assert "--build-arg VLLM_VERSION=0.32.0" in m.group(1)
    assert "--build-arg BASE=vllm/vllm-openai:v0.32.0" in m.group(1)
    k3 = yaml.safe_load((ROOT / "recipes" / "k3.yaml").read_text())
    assert k3["cluster"]["container"] == DEFAULT_IMAGE
    assert f"RUN+=({DEFAULT_IMAGE} python3)" in (ROOT / "launch" / "k3_stage1.sbatch").read_text()


def test_make_image_suffix_and_digest_name_their_own_image():
    build = " ".join(_make_image("IMAGE_TAG_SUFFIX=-test", "BASE_DIGEST=sha256:abc").stdout.split())
    assert "images/hpctoolkit-vllm-0.32.0-test.sif apptainer/hpctoolkit.def" in build
    assert "--build-arg BASE=vllm/vllm-openai@sha256:abc" in build
    assert "--build-arg BASE_DIGEST=sha256:abc" in build


def test_make_image_refuses_a_vllm_without_a_series():
    res = subprocess.run(
        ["make", "--no-print-directory", "image", "APPTAINER=true", "BASE_DIGEST=unknown", "VLLM_VERSION=0.31.0"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert res.returncode != 0 and "only a pinned directory under patches/vllm/ carries one" in res.stderr
