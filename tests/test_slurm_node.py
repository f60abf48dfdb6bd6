"""`python -m hpctoolkit.node`: role selection from the plan and the Slurm environment, dry mode,
the digest guard and the environment handed to trainers. No Slurm needed: the environment is faked."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctoolkit import node
from hpctoolkit.config import load_recipe
from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.placement import make_plan

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "tests/golden/emulated_3node.yaml"
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURMD_NODENAME", "SLURM_PROCID", "SLURM_LOCALID")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.chdir(ROOT)
    for name in (
        *SLURM_VARS,
        "SLURM_NODELIST",
        "SLURM_JOBID",
        "HPCTOOLKIT_PLAN_DIGEST",
        "HPCTOOLKIT_NODE_DRY",
    ):
        monkeypatch.delenv(name, raising=False)


def on_node(monkeypatch, name: str, procid: int = 0, localid: int = 0, cvd: str = "0,1") -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[4-6]")
    monkeypatch.setenv("SLURMD_NODENAME", name)
    monkeypatch.setenv("SLURM_PROCID", str(procid))
    monkeypatch.setenv("SLURM_LOCALID", str(localid))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cvd)


def digest() -> str:
    return make_plan(load_recipe(RECIPE)).digest()


def test_engine_roles_find_their_node(monkeypatch):
    on_node(monkeypatch, "node6")
    ctx = node.load_context(RECIPE, [])
    assert ctx.node == 2 and ctx.hosts == ("node4", "node5", "node6")
    proc = node.select_process(ctx, "engine-follower")
    assert (proc.engine, proc.node_rank, proc.gpus) == (0, 1, (0, 1))
    line = node.dry_line(ctx, proc)
    assert line.startswith("role=engine-follower node=node6 engine=0 node_rank=1 gpus=0,1 ")
    with pytest.raises(ConfigError, match="no engine-leader on node n2"):
        node.select_process(ctx, "engine-leader")


def test_trainer_rank_comes_from_procid(monkeypatch):
    on_node(monkeypatch, "node4", procid=3, localid=3, cvd="0,1,2,3")
    ctx = node.load_context(RECIPE, [])
    proc = node.select_process(ctx, "trainer")
    assert (proc.node_rank, proc.local_rank, proc.gpus) == (3, 3, (3,))
    env = node.trainer_env(ctx, proc)
    assert env == {
        "RANK": "3",
        "LOCAL_RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node4",
        "MASTER_PORT": "29500",
    }
    monkeypatch.setattr(node.socket, "gethostbyname", lambda h: {"node4": "10.0.0.4"}[h])
    assert node.store_address(ctx) == "10.0.0.4:50051"
    assert "rank=3 local_rank=3" in node.dry_line(ctx, proc)


def test_trainer_on_the_wrong_node_or_task_fails(monkeypatch):
    on_node(monkeypatch, "node5", procid=0)
    with pytest.raises(ConfigError, match="no trainer on node n1"):
        node.select_process(node.load_context(RECIPE, []), "trainer")
    on_node(monkeypatch, "node4", procid=2, localid=1)
    with pytest.raises(ConfigError, match="local task 1"):
        node.select_process(node.load_context(RECIPE, []), "trainer")


def test_stale_script_is_refused(monkeypatch):
    on_node(monkeypatch, "node4")
    monkeypatch.setenv("HPCTOOLKIT_PLAN_DIGEST", "0123456789abcdef")
    with pytest.raises(ConfigError, match="re-render"):
        node.load_context(RECIPE, [])
    monkeypatch.setenv("HPCTOOLKIT_PLAN_DIGEST", digest())
    assert node.load_context(RECIPE, []).node == 0
    # Overrides that change the placement change the digest too.
    with pytest.raises(ConfigError, match="re-render"):
        node.load_context(RECIPE, ["training.world_size=2"])


def test_job_size_must_match(monkeypatch):
    on_node(monkeypatch, "node4")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[4-5]")
    with pytest.raises(ConfigError, match="2 node"):
        node.load_context(RECIPE, [])


def test_slurm_roles_outside_slurm():
    with pytest.raises(ConfigError, match="inside a Slurm job"):
        node.load_context(RECIPE, [])


def test_main_dry_prints_one_line(monkeypatch, capsys):
    on_node(monkeypatch, "node5")
    monkeypatch.setenv("HPCTOOLKIT_NODE_DRY", "1")
    assert node.main(["engine-leader", RECIPE]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["role=engine-leader node=node5 engine=0 node_rank=0 gpus=0,1 planned_gpus=0,1 index=1"]
    assert node.main(["check", RECIPE]) == 0


def test_main_usage_errors():
    with pytest.raises(ConfigError, match="usage"):
        node.main([])
    with pytest.raises(ConfigError, match="unknown role 'boss'"):
        node.main(["boss", RECIPE])


def test_cli_exit_code_2(monkeypatch, capsys):
    from hpctoolkit.cli import run_cli

    with pytest.raises(SystemExit) as err:
        run_cli(node.main, ["boss", RECIPE])
    assert err.value.code == 2
    assert "unknown role" in capsys.readouterr().err


def test_run_task_picks_by_local_id(monkeypatch, capsys):
    plan = make_plan(load_recipe(RECIPE))
    on_node(monkeypatch, "node4", localid=0)
    assert node.run_task(plan, RECIPE, [], True).startswith("role=master node=node4")
    on_node(monkeypatch, "node4", localid=4)
    assert node.run_task(plan, RECIPE, [], True).startswith("role=trainer node=node4")
    on_node(monkeypatch, "node5", localid=1)
    assert node.run_task(plan, RECIPE, [], True) is None  # spare task on an engine node


def test_real_roles_say_what_is_missing(monkeypatch):
    on_node(monkeypatch, "node5")
    ctx = node.load_context(RECIPE, [])
    with pytest.raises(NotImplementedError, match=r"build_llm_kwargs refuses engine\.nnodes>1"):
        node.run_process(ctx, node.select_process(ctx, "engine-leader"), dry=False)
    on_node(monkeypatch, "node4")
    ctx = node.load_context(RECIPE, [])
    with pytest.raises(NotImplementedError, match="live"):
        node.run_process(ctx, node.select_process(ctx, "trainer"), dry=False)


def test_dry_roles_parsing():
    assert node.dry_roles("1") == {"master", "engine-leader", "engine-follower", "trainer"}
    assert node.dry_roles(None) == node.dry_roles("0") == node.dry_roles("") == frozenset()
    assert node.dry_roles("trainer, engine-leader") == {"trainer", "engine-leader"}
    with pytest.raises(ConfigError, match="boss"):
        node.dry_roles("trainer,boss")


def test_wait_reachable():
    import socket

    from hpctoolkit.errors import StoreError

    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        assert node.wait_reachable(f"127.0.0.1:{port}", 5) < 5
    with pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
        node.wait_reachable(f"127.0.0.1:{port}", 0.3)


def test_partly_dry_roles_wait_for_the_real_master(monkeypatch, capsys):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        on_node(monkeypatch, "node5")
        monkeypatch.setenv("HPCTOOLKIT_NODE_DRY", "engine-leader,engine-follower,trainer")
        ctx = node.load_context(RECIPE, [f"store.master_port={port}"])
        monkeypatch.setattr(node.socket, "gethostbyname", lambda h: "127.0.0.1")
        line = node.run_process(ctx, node.select_process(ctx, "engine-leader"))
    assert f" store=127.0.0.1:{port} reached_after_s=" in line
