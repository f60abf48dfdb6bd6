"""Submission without a cluster: submitit parameters from the plan, `sbatch` through a fake binary,
the one-shot command runner, and the rule that only `hpctoolkit/slurm/shell.py` runs commands."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.placement import make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.slurm import shell
from hpctoolkit.slurm.env import time_limit_minutes
from hpctoolkit.slurm.handoff import executor_parameters, submit_sbatch
from hpctoolkit.slurm.render import load_for_render

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _root(monkeypatch):
    monkeypatch.chdir(ROOT)


def test_executor_parameters_from_the_k3_plan():
    cfg, _ = load_for_render("recipes/k3.yaml")
    params = executor_parameters(cfg, make_plan(cfg))
    assert params == {
        "job_name": "k3-stage1",
        "nodes": 5,
        "ntasks_per_node": 9,
        "gpus_per_node": 8,
        "time": 48 * 60,
        "signal_delay_s": 120,
        "exclusive": True,
    }


def test_executor_parameters_accepted_by_submitit(tmp_path):
    submitit = pytest.importorskip("submitit")
    cfg = load_recipe("tests/golden/small_2node.yaml")
    ex = submitit.SlurmExecutor(folder=str(tmp_path))
    ex.update_parameters(**executor_parameters(cfg, make_plan(cfg)))
    text = ex._make_submission_file_text("python -m x", "UID")
    for line in (
        "--nodes=2",
        "--ntasks-per-node=5",
        "--gpus-per-node=4",
        "--partition=debug",
        "--account=research",
    ):
        assert f"#SBATCH {line}" in text


def test_local_plan_is_refused():
    cfg = load_recipe("recipes/tiny.yaml")
    with pytest.raises(ConfigError, match="backend=slurm"):
        executor_parameters(cfg, make_plan(cfg))


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("04:00:00", 240), ("48:00:00", 2880), ("1-00:00:00", 1440), ("30", 30), ("10:30", 11), ("00:00:01", 1)],
)
def test_timeout_minutes(text, minutes):
    assert time_limit_minutes(text) == minutes


def test_timeout_rejects_garbage():
    with pytest.raises(ConfigError, match=r"cluster\.time"):
        time_limit_minutes("1:2:3:4")


def fake_sbatch(tmp_path: Path, body: str) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "sbatch"
    exe.write_text("#!/bin/bash\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_submit_sbatch_reads_the_job_id(tmp_path):
    env = fake_sbatch(tmp_path, 'cat > "$PWD/got.sbatch"; echo "$@" > "$PWD/args"; echo "4711;hpctoolkit"\n')
    job = submit_sbatch("#!/bin/bash\necho hi\n", tmp_path, env=env)
    assert job == "4711"
    assert (tmp_path / "got.sbatch").read_text() == "#!/bin/bash\necho hi\n"
    assert (tmp_path / "args").read_text().strip() == "--parsable"


def test_submit_sbatch_passes_script_arguments(tmp_path):
    """With arguments the script goes through a file of its own (sbatch reads it before it
    returns), removed once submitted: concurrent submissions from one folder cannot swap scripts."""
    env = fake_sbatch(tmp_path, 'echo "$@" > "$PWD/args"; cp "$2" "$PWD/got.sbatch"; echo 12\n')
    assert submit_sbatch("#!/bin/bash\n", tmp_path, args=["paths.output_dir=/x"], env=env) == "12"
    args = (tmp_path / "args").read_text().split()
    assert args[0] == "--parsable" and args[-1] == "paths.output_dir=/x"
    assert (tmp_path / "got.sbatch").read_text() == "#!/bin/bash\n"
    assert not list(tmp_path.glob(".hpctoolkit-submit*"))


def test_submit_sbatch_errors(tmp_path):
    env = fake_sbatch(tmp_path, 'echo "sbatch: error: Invalid partition name specified" >&2; exit 1\n')
    with pytest.raises(shell.CommandError, match="Invalid partition"):
        submit_sbatch("#!/bin/bash\n", tmp_path, env=env)


def test_shell_run():
    assert shell.run(["printf", "a b"]) == "a b"
    assert shell.run(["cat"], stdin="x\n") == "x\n"
    with pytest.raises(shell.CommandError) as err:
        shell.run(["false"])
    assert err.value.returncode == 1
    with pytest.raises(shell.CommandError, match="command not found"):
        shell.run(["hpctoolkit-no-such-binary"])
    with pytest.raises(shell.CommandError, match="timed out"):
        shell.run(["sleep", "5"], timeout_s=0.2)


ONE_SHOT = {"run", "check_output", "check_call", "call", "getoutput", "getstatusoutput"}


def test_one_shot_commands_only_in_shell_py():
    """`subprocess.run` & co. appear in exactly one module; services use Popen where they live."""
    offenders = []
    for path in sorted((ROOT / "hpctoolkit").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        for n in ast.walk(tree):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
                base = n.func.value
                if isinstance(base, ast.Name) and (
                    (base.id == "subprocess" and n.func.attr in ONE_SHOT)
                    or (base.id == "os" and n.func.attr in {"system", "popen"})
                ):
                    offenders.append(f"{rel}:{n.lineno} {base.id}.{n.func.attr}")
    offenders = [o for o in offenders if not o.startswith("hpctoolkit/slurm/shell.py:")]
    assert offenders == [], "run one-shot commands through hpctoolkit.slurm.shell.run"


def test_submitit_runs_every_task_in_the_image_with_the_recipe_paths_bound(tmp_path):
    pytest.importorskip("submitit")
    from hpctoolkit.slurm.handoff import make_executor

    out = tmp_path / "out"
    cfg, _ = load_for_render("recipes/k3.yaml", [f"paths.output_dir={out}", "paths.target_model=/models/k3"])
    ex = make_executor(cfg, make_plan(cfg), folder=tmp_path / "submitit", recipe_path="recipes/k3.yaml")
    text = ex._make_submission_file_text(ex._submitit_command_str, "UID")
    command = text.splitlines()[-1] if text.splitlines()[-1].strip() else text.splitlines()[-2]
    assert (
        "apptainer exec --nv" in command and "images/hpctoolkit-vllm-0.32.0-pp-export.sif python3" in command
    )
    assert f"--bind {out}" in command and "--bind /models/k3" in command
    assert command.index("apptainer") > command.index("srun") and "-m submitit.core._submit" in command
    # Every task writes to the run's one log, as the batch script's steps do.
    assert f"--output {out}/slurm-%j.out" in command
    assert "#SBATCH --signal=USR2@120" in text


def test_submitit_without_container_runs_this_python(tmp_path):
    pytest.importorskip("submitit")
    import sys

    from hpctoolkit.slurm.handoff import make_executor

    cfg = load_recipe("tests/golden/small_2node.yaml", [f"paths.output_dir={tmp_path}"])
    ex = make_executor(
        cfg, make_plan(cfg), folder=tmp_path / "s", recipe_path="tests/golden/small_2node.yaml"
    )
    assert ex.python.strip("'") == sys.executable


@pytest.mark.parametrize(
    ("recipe", "overrides", "watcher"),
    [
        ("recipes/k3.yaml", [], False),
        ("tests/recipes/slurm_preempt.yaml", [], False),
        ("tests/recipes/slurm_preempt.yaml", ["store.master_address=127.0.0.1:50999"], True),
        ("recipes/k3.yaml", ["store.master_address=10.0.0.1:50051"], True),
    ],
)
def test_task_zero_keeps_submitits_requeue_handler(recipe, overrides, watcher):
    """Global task 0 runs the master (which leaves SIGUSR2 to submitit) or, with an external
    master, the watcher; every planned process gets exactly one task."""
    from hpctoolkit.plan.placement import ROLE_MASTER, Process
    from hpctoolkit.slurm.tasks import WATCHER, task_process, tasks_per_node

    cfg, _ = load_for_render(recipe, overrides)
    plan = make_plan(cfg)
    n = tasks_per_node(plan)
    tasks = {(node, i): task_process(plan, node, i) for node in range(plan.num_nodes) for i in range(n)}
    first = tasks[(0, 0)]
    assert first == WATCHER if watcher else isinstance(first, Process) and first.role == ROLE_MASTER
    placed = {key: t for key, t in tasks.items() if isinstance(t, Process)}
    assert sorted(map(repr, placed.values())) == sorted(map(repr, plan.processes()))
    assert all(t.node == node for (node, _), t in placed.items())
    assert n == plan.max_processes_per_node() + (
        watcher and len(plan.on_node(0)) == plan.max_processes_per_node()
    )
    assert executor_parameters(cfg, plan)["ntasks_per_node"] == n
