"""The batch script renderer against golden files, plus properties every rendered script has.

Golden files live in tests/golden/*.sbatch; launch/k3_stage1.sbatch is the render of
recipes/k3.yaml and must stay byte-identical to it. After an intended change, rewrite them all:

    .venv/bin/python tests/unit/test_render.py --update-golden

and review the diff before committing.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # when run as a script for --update-golden
    sys.path.insert(0, str(ROOT))

from hpctoolkit.errors import ConfigError  # noqa: E402
from hpctoolkit.plan.placement import make_plan  # noqa: E402
from hpctoolkit.slurm.container import DEFAULT_IMAGE  # noqa: E402
from hpctoolkit.slurm.render import DEFERRED, load_for_render, render_sbatch  # noqa: E402

GOLDEN = ROOT / "tests" / "golden"
LAUNCH_K3 = ROOT / "launch" / "k3_stage1.sbatch"
# golden file -> (recipe as passed on the command line, overrides)
CASES = {
    "k3.sbatch": ("recipes/k3.yaml", []),
    "small_2node.sbatch": ("tests/golden/small_2node.yaml", []),
    "emulated_3node.sbatch": ("tests/golden/emulated_3node.yaml", []),
    "k3_with_paths.sbatch": (
        "recipes/k3.yaml",
        [
            "paths.output_dir=/scratch/k3 run",
            "paths.target_model=/models/Kimi-K3",
            "data.prompts=/data/p.jsonl",
        ],
    ),
}


def render(recipe: str, overrides: list[str]) -> str:
    cfg, _ = load_for_render(ROOT / recipe, overrides)
    return render_sbatch(cfg, make_plan(cfg), recipe_path=recipe, overrides=overrides)


@pytest.fixture(autouse=True)
def _repo_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name their draft configs relative to the repository


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    recipe, overrides = CASES[name]
    want = (GOLDEN / name).read_text()
    assert render(recipe, overrides) == want, f"{name} changed; see this module's docstring to update"


def test_launch_k3_is_the_render_of_the_recipe():
    assert LAUNCH_K3.read_text() == render("recipes/k3.yaml", []), (
        "launch/k3_stage1.sbatch is stale: python -m hpctoolkit.submit recipes/k3.yaml --render-sbatch "
        "> launch/k3_stage1.sbatch (or tests/unit/test_render.py --update-golden)"
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_scripts_pass_shellcheck_and_bash_n(name, tmp_path):
    path = tmp_path / name
    path.write_text(render(*CASES[name]))
    subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (launch/system_deps.sh installs it)")
    out = subprocess.run(["shellcheck", "-s", "bash", str(path)], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout


def _sbatch(text: str) -> dict[str, str]:
    pattern = r"^#SBATCH --([\w-]+)(?:=(.*))?$"
    return {m.group(1): m.group(2) or "" for m in re.finditer(pattern, text, re.M)}


def test_k3_header_derives_from_the_plan():
    text = render("recipes/k3.yaml", [])
    opts = _sbatch(text)
    assert opts["nodes"] == "5" and opts["gpus-per-node"] == "8"
    assert opts["ntasks-per-node"] == "9"  # master + 8 trainer ranks on node 0
    assert opts["signal"] == "B:USR2@120" and opts["time"] == "48:00:00"
    assert opts["job-name"] == "k3-stage1" and "exclusive" in opts
    assert opts["output"] == "%x-%j.out"  # output_dir is ??? until submission
    assert "partition" not in opts and "account" not in opts
    assert "paths.output_dir=... paths.target_model=..." in text
    assert DEFERRED not in text


def test_one_step_per_role_on_the_planned_node():
    cfg, _ = load_for_render(ROOT / "recipes/k3.yaml")
    plan = make_plan(cfg)
    text = render("recipes/k3.yaml", [])
    steps = re.findall(r'^srun (.*?) \\\n  "\$\{RUN\[@\]\}" -m hpctoolkit\.roles (\S+) ', text, re.M)
    roles = [(role, re.search(r'--nodelist="\$\(hosts ([\d ]+)\)"', opts).group(1)) for opts, role in steps]
    want = [("master", "0")]
    want += [(n.role, str(n.node)) for e in plan.engines for n in e.nodes]
    want += [("trainer", "0")]
    assert roles == want
    gres = [re.search(r"--gres=gpu:(\d+)", opts).group(1) for opts, _ in steps]
    assert gres == ["0", "8", "8", "8", "8", "8"]
    assert "--ntasks=8 --ntasks-per-node=8" in steps[-1][0]
    assert text.count("RUN=(apptainer exec --nv)") == 1
    assert text.count(f"RUN+=({DEFAULT_IMAGE} python3)") == 1


def test_small_recipe_sets_partition_account_extra_and_output():
    opts = _sbatch(render("tests/golden/small_2node.yaml", []))
    assert opts["partition"] == "debug" and opts["account"] == "research" and opts["qos"] == "normal"
    assert opts["output"] == "runs/small-2node/slurm-%j.out"
    assert opts["nodes"] == "2" and opts["gpus-per-node"] == "4"


def test_no_container_runs_the_python_on_path():
    text = render("tests/golden/emulated_3node.yaml", [])
    assert 'RUN=("${HPCTOOLKIT_PYTHON:-python3}")' in text and "apptainer" not in text
    assert "#SBATCH --exclusive" not in text


def test_overrides_are_baked_and_quoted():
    text = render(*CASES["k3_with_paths.sbatch"])
    assert "OVERRIDES=('paths.output_dir=/scratch/k3 run' paths.target_model=/models/Kimi-K3" in text
    assert _sbatch(text)["output"] == "/scratch/k3 run/slurm-%j.out"
    assert "give them as arguments to sbatch" not in text


def test_known_paths_outside_the_image_are_bound_and_the_output_dir_made():
    text = render(*CASES["k3_with_paths.sbatch"])
    # The draft config is relative (the working directory, which Apptainer mounts): no bind.
    assert (
        "RUN=(apptainer exec --nv --bind '/scratch/k3 run' --bind /models/Kimi-K3 --bind /data/p.jsonl)"
        in text
    )
    assert "mkdir -p -- '/scratch/k3 run'\nRUN=(" in text
    assert "recipes/draft_models" not in text.split("RUN=(", 1)[1].split("\n", 1)[0]


def test_paths_given_to_sbatch_are_bound_by_the_script(tmp_path):
    """The rendered RUN-building lines, run by bash with sbatch-style arguments."""
    text = render("recipes/k3.yaml", [])
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("RUN=("))
    end = next(i for i, line in enumerate(lines) if line.startswith("RUN+=("))
    out = tmp_path / "out dir"
    script = "\n".join(["set -euo pipefail", *lines[start : end + 1], 'printf "%s\\n" "${RUN[@]}"'])
    args = [
        f"paths.output_dir={out}",
        "paths.target_model=/models/k3",
        "data.prompts=/opt/hpctoolkit/recipes/prompts.jsonl",  # the image's own: not bound
        "draft.config=relative/draft.json",  # in the working directory: not bound
        "training.steps=5",
    ]
    res = subprocess.run(["bash", "-c", script, "job", *args], capture_output=True, text=True, check=True)
    assert res.stdout.splitlines() == [
        "apptainer", "exec", "--nv", "--bind", str(out), "--bind", "/models/k3", DEFAULT_IMAGE, "python3",
    ]  # fmt: skip
    assert out.is_dir()


def test_bind_paths_outside_the_image_only_once_each():
    from hpctoolkit.slurm.container import bind_paths

    got = bind_paths(
        [
            ("paths.output_dir", "/scratch/run/"),
            ("paths.target_model", "/models/k3"),
            ("data.prompts", "/models/k3/prompts.jsonl"),  # under a bound path: covered
            ("draft.config", "/opt/hpctoolkit/recipes/draft_models/x.json"),  # the image's own
            ("recipe", "recipes/k3.yaml"),  # relative: the working directory
            ("other", "builtin:tiny"),  # no path
            ("unset", None),
            ("again", "/scratch/run"),
        ]
    )
    assert got == ["/scratch/run", "/models/k3"]
    with pytest.raises(ConfigError, match=r"data\.prompts"):
        bind_paths({"data.prompts": "/data/a,b.jsonl"})


def test_command_prefix_for_the_submitit_path():
    from hpctoolkit.slurm.container import command_prefix

    cfg, _ = load_for_render(
        ROOT / "recipes/k3.yaml",
        ["paths.output_dir=/scratch/k3", "paths.target_model=/models/K3", "data.prompts=/data/p.jsonl"],
    )
    assert command_prefix(cfg, recipe_path="/home/me/k3.yaml") == [
        "apptainer", "exec", "--nv", "--bind", "/scratch/k3", "--bind", "/models/K3",
        "--bind", "/data/p.jsonl", "--bind", "/home/me/k3.yaml", DEFAULT_IMAGE, "python3",
    ]  # fmt: skip
    cfg.cluster.container = None
    assert command_prefix(cfg) is None


def test_digest_is_exported_and_matches_the_plan():
    cfg, _ = load_for_render(ROOT / "recipes/k3.yaml")
    text = render("recipes/k3.yaml", [])
    assert f"export HPCTOOLKIT_PLAN_DIGEST={make_plan(cfg).digest()}\n" in text


def test_render_is_pure_and_deterministic():
    assert render("recipes/k3.yaml", []) == render("recipes/k3.yaml", [])


def test_local_plans_do_not_render():
    cfg, _ = load_for_render(ROOT / "recipes/tiny.yaml")
    with pytest.raises(ValueError, match="slurm"):
        render_sbatch(cfg, make_plan(cfg), recipe_path="recipes/tiny.yaml")


def test_load_for_render_still_rejects_bad_keys():
    with pytest.raises(ConfigError, match=r"cluster\.nodez"):
        load_for_render(ROOT / "recipes/k3.yaml", ["cluster.nodez=3"])


def _update() -> None:
    for name, (recipe, overrides) in CASES.items():
        (GOLDEN / name).write_text(render(recipe, overrides))
        print(f"wrote tests/golden/{name}")
    LAUNCH_K3.write_text(render("recipes/k3.yaml", []))
    print("wrote launch/k3_stage1.sbatch")


if __name__ == "__main__":
    if sys.argv[1:] != ["--update-golden"]:
        sys.exit("usage: python tests/unit/test_render.py --update-golden")
    import os

    os.chdir(ROOT)
    _update()
