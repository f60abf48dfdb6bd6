"""`python -m hpctoolkit.roles`: role selection from the plan and the Slurm environment, dry mode,
the digest guard and the environment handed to trainers. No Slurm needed: the environment is faked."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from hpctoolkit.errors import ConfigError, StoreError
from hpctoolkit.plan.placement import make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.roles import __main__ as roles_main
from hpctoolkit.roles import context, dispatch, trainer, waits
from hpctoolkit.roles.network import HostAddress, choose
from hpctoolkit.rundir.atomic import read_json, write_json_atomic

ROOT = Path(__file__).resolve().parents[2]
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


ADDRESSES = {"node4": "10.0.0.4", "node5": "10.0.0.5", "node6": "10.0.0.6"}


def on_host(monkeypatch, name: str) -> None:
    """This process's data-plane address is `name`'s (as `cluster.network` would find it there)."""
    monkeypatch.setattr(context, "local_address", lambda net, host: HostAddress("eth0", ADDRESSES[name]))


def master_up(ctx, address: str = "10.0.0.4:50051") -> None:
    write_json_atomic(ctx.run.master_record, {"run_id": ctx.run_id, "address": address})


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
    ctx = context.load_context(RECIPE, [])
    assert ctx.node == 2 and ctx.hosts == ("node4", "node5", "node6")
    proc = context.select_process(ctx, "engine-follower")
    assert (proc.engine, proc.node_rank, proc.gpus) == (0, 1, (0, 1))
    line = dispatch.dry_line(ctx, proc)
    assert line.startswith("role=engine-follower node=node6 engine=0 node_rank=1 gpus=0,1 ")
    with pytest.raises(ConfigError, match="no engine-leader on node n2"):
        context.select_process(ctx, "engine-leader")


def test_trainer_rank_comes_from_procid(monkeypatch, tmp_path):
    on_node(monkeypatch, "node4", procid=3, localid=3, cvd="0,1,2,3")
    on_host(monkeypatch, "node4")
    ctx = context.load_context(RECIPE, [f"paths.output_dir={tmp_path}"])
    proc = context.select_process(ctx, "trainer")
    assert (proc.node_rank, proc.local_rank, proc.gpus) == (3, 3, (3,))
    # Rank 0 recorded where its store listens (port picked at start); rank 3 waits for that.
    context.publish_port(dataclasses.replace(ctx, node=0), "trainers", 40123)
    rendezvous, listening = context.trainer_rendezvous(ctx, proc)
    assert listening is None and rendezvous == context.Endpoint("10.0.0.4", 40123)
    env = context.trainer_env(ctx, proc, rendezvous)
    assert env == {
        "RANK": "3",
        "LOCAL_RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.4",  # its node's data-plane address, never a name lookup
        "MASTER_PORT": "40123",
    }
    master_up(ctx)
    assert context.store_address(ctx) == "10.0.0.4:50051"
    assert context.client_store_config(ctx).bind_host == "10.0.0.4"  # what its readers advertise
    assert "rank=3 local_rank=3" in dispatch.dry_line(ctx, proc)


def test_trainer_on_the_wrong_node_or_task_fails(monkeypatch):
    on_node(monkeypatch, "node5", procid=0)
    with pytest.raises(ConfigError, match="no trainer on node n1"):
        context.select_process(context.load_context(RECIPE, []), "trainer")
    on_node(monkeypatch, "node4", procid=2, localid=1)
    with pytest.raises(ConfigError, match="local task 1"):
        context.select_process(context.load_context(RECIPE, []), "trainer")


def test_stale_script_is_refused(monkeypatch):
    on_node(monkeypatch, "node4")
    monkeypatch.setenv("HPCTOOLKIT_PLAN_DIGEST", "0123456789abcdef")
    with pytest.raises(ConfigError, match="re-render"):
        context.load_context(RECIPE, [])
    monkeypatch.setenv("HPCTOOLKIT_PLAN_DIGEST", digest())
    assert context.load_context(RECIPE, []).node == 0
    # Overrides that change the placement change the digest too.
    with pytest.raises(ConfigError, match="re-render"):
        context.load_context(RECIPE, ["training.world_size=2"])


def test_job_size_must_match(monkeypatch):
    on_node(monkeypatch, "node4")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[4-5]")
    with pytest.raises(ConfigError, match="2 node"):
        context.load_context(RECIPE, [])


def test_slurm_roles_outside_slurm():
    with pytest.raises(ConfigError, match="inside a Slurm job"):
        context.load_context(RECIPE, [])


def test_main_dry_prints_one_line(monkeypatch, capsys, tmp_path):
    on_node(monkeypatch, "node5")
    monkeypatch.setenv("HPCTOOLKIT_NODE_DRY", "1")
    assert roles_main.main(["engine-leader", RECIPE]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["role=engine-leader node=node5 engine=0 node_rank=0 gpus=0,1 planned_gpus=0,1 index=1"]
    assert roles_main.main(["check", RECIPE, f"paths.output_dir={tmp_path}"]) == 0
    # The check step records the resolved recipe in the job's run directory.
    assert (tmp_path / "emulated-3node-j42" / "config.yaml").is_file()


def test_main_usage_errors():
    with pytest.raises(ConfigError, match="required: role, recipe"):
        roles_main.main([])
    with pytest.raises(ConfigError, match="invalid choice: 'boss'"):
        roles_main.main(["boss", RECIPE])


def test_cli_exit_code_2(monkeypatch, capsys):
    from hpctoolkit.cli import run_cli

    with pytest.raises(SystemExit) as err:
        run_cli(roles_main.main, ["boss", RECIPE])
    assert err.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_run_task_picks_by_local_id(monkeypatch, capsys):
    plan = make_plan(load_recipe(RECIPE))
    on_node(monkeypatch, "node4", localid=0)
    assert dispatch.run_task(plan, RECIPE, [], True).startswith("role=master node=node4")
    on_node(monkeypatch, "node4", localid=4)
    assert dispatch.run_task(plan, RECIPE, [], True).startswith("role=trainer node=node4")
    on_node(monkeypatch, "node5", localid=1)
    assert dispatch.run_task(plan, RECIPE, [], True) is None  # spare task on an engine node


def test_run_id_and_engine_shares(monkeypatch):
    on_node(monkeypatch, "node5")
    assert context.load_context(RECIPE, []).run_id == "emulated-3node-j42"
    assert [trainer.engine_share(12, 3, e) for e in range(3)] == [4, 4, 4]
    assert [trainer.engine_share(10, 3, e) for e in range(3)] == [4, 3, 3]
    assert sum(trainer.engine_share(7, 2, e) for e in range(2)) == 7


def test_leader_and_follower_build_one_engine_config(monkeypatch, tmp_path):
    """Both engine roles call `engine_llm_kwargs` with `engine_node_args`: only the node keys differ."""
    import json

    from hpctoolkit.engine.follower import NODE_KEYS, check_node_invariant
    from hpctoolkit.engine.kwargs import CaptureSink, engine_llm_kwargs

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 6}))
    built = {}
    out = f"paths.output_dir={tmp_path / 'out'}"
    monkeypatch.setattr(context, "free_port", lambda address: 40200)  # 10.0.0.5 is not this host's
    for name, role in (("node5", "engine-leader"), ("node6", "engine-follower")):
        on_node(monkeypatch, name)
        on_host(monkeypatch, name)
        ctx = context.load_context(RECIPE, [out])
        context.note_host(ctx)  # what every role does first: the follower learns the leader's address
        master_up(ctx)
        args = context.engine_node_args(ctx, context.select_process(ctx, role), cores=[2, 3])
        sink = CaptureSink(context.store_address(ctx), ctx.cfg.store, ctx.run_id, 0, str(ctx.run.faults(0)))
        _, kwargs, env = engine_llm_kwargs(ctx.cfg.engine, tmp_path, sink, args, backend="cpu")
        built[role] = (args, kwargs, env)
    (la, lk, le), (fa, fk, fe) = built["engine-leader"], built["engine-follower"]
    assert (la.node_rank, fa.node_rank) == (0, 1)
    assert la.master_addr == fa.master_addr == "10.0.0.5"  # the leader's node
    # Picked by the leader at start, recorded, read by the follower (no fixed port).
    assert read_json(ctx.run.port_record("engine0"))["port"] == la.master_port == fa.master_port
    assert (le["VLLM_HOST_IP"], fe["VLLM_HOST_IP"]) == ("10.0.0.5", "10.0.0.6")
    assert le["VLLM_CPU_OMP_THREADS_BIND"] == fe["VLLM_CPU_OMP_THREADS_BIND"] == "2|3"  # 2 workers a node

    def shared(kw):
        return {k: v for k, v in kw.items() if k not in NODE_KEYS}

    assert shared(lk) == shared(fk)
    check_node_invariant(shared(fk))
    assert lk["kv_transfer_config"]["engine_id"] == "emulated-3node-j42-e0"
    extra = fk["kv_transfer_config"]["kv_connector_extra_config"]["hpctoolkit"]
    assert extra["fault_dir"] == str(ctx.run.faults(0))
    assert extra["store_address"] == "10.0.0.4:50051"


def test_dry_roles_parsing():
    assert dispatch.dry_roles("1") == {"master", "engine-leader", "engine-follower", "trainer"}
    assert dispatch.dry_roles(None) == dispatch.dry_roles("0") == dispatch.dry_roles("") == frozenset()
    assert dispatch.dry_roles("trainer, engine-leader") == {"trainer", "engine-leader"}
    with pytest.raises(ConfigError, match="boss"):
        dispatch.dry_roles("trainer,boss")


def test_wait_reachable():
    import socket

    from hpctoolkit.errors import StoreError

    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        assert waits.wait_reachable(f"127.0.0.1:{port}", 5) < 5
    with pytest.raises(StoreError, match=f"127.0.0.1:{port}"):
        waits.wait_reachable(f"127.0.0.1:{port}", 0.3)


def test_partly_dry_roles_wait_for_the_real_master(monkeypatch, capsys, tmp_path):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        on_node(monkeypatch, "node5")
        monkeypatch.setenv("HPCTOOLKIT_NODE_DRY", "engine-leader,engine-follower,trainer")
        ctx = context.load_context(RECIPE, [f"store.master_port={port}", f"paths.output_dir={tmp_path}"])
        master_up(ctx, f"127.0.0.1:{port}")  # the real master's record of where it listens
        line = dispatch.run_process(ctx, context.select_process(ctx, "engine-leader"))
    assert f" store=127.0.0.1:{port} reached_after_s=" in line


def test_network_choice_by_interface_or_cidr():
    ifaces = {"lo": "127.0.0.1", "eth0": "192.168.5.2", "ib0": "10.1.3.4"}
    assert choose("ib0", ifaces, "h") == HostAddress("ib0", "10.1.3.4")
    assert choose("10.1.0.0/16", ifaces, "h") == HostAddress("ib0", "10.1.3.4")
    assert choose("lo", ifaces, "h").loopback
    with pytest.raises(
        ConfigError, match=r"cluster.network='ib1': host h has no address on it.*ib0=10.1.3.4"
    ):
        choose("ib1", ifaces, "h")
    with pytest.raises(ConfigError, match=r"cluster.network='10.9.0.0/16'"):
        choose("10.9.0.0/16", ifaces, "h")
    with pytest.raises(ConfigError, match="neither an interface nor a CIDR"):
        choose("10.9.0.0/99", ifaces, "h")


def test_a_multi_node_slurm_job_must_name_its_network(tmp_path):
    with pytest.raises(ConfigError, match=r"cluster\.network"):
        load_recipe(RECIPE, ["cluster.network=null"])


def test_a_host_without_the_network_fails_naming_the_setting(monkeypatch):
    on_node(monkeypatch, "node5")
    with pytest.raises(ConfigError, match=r"cluster.network='ib9': host node5 has no address on it"):
        context.load_context(RECIPE, ["cluster.network=ib9"])


def test_a_follower_waits_for_its_leaders_address_and_names_it(monkeypatch, tmp_path):
    on_node(monkeypatch, "node6")
    on_host(monkeypatch, "node6")
    ctx = context.load_context(RECIPE, [f"paths.output_dir={tmp_path}"])
    with pytest.raises(StoreError, match=r"no role on node n1 \(node5\) recorded its address"):
        context.address_of(ctx, 1, timeout_s=0.3)
