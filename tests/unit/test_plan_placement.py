"""The placement plan: the reference K3 deployment, sweeps over engine/node/PP/GPU layouts, and the
refusals. Pure and fast: configs are built in memory (no target or draft files are read)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.config import ClusterConfig
from hpctoolkit.plan.placement import (
    LOCALHOST,
    ROLE_ENGINE_FOLLOWER,
    ROLE_ENGINE_LEADER,
    ROLE_MASTER,
    ROLE_TRAINER,
    Plan,
    make_plan,
)
from hpctoolkit.plan.ports import PICKED, engine_listener
from hpctoolkit.recipe.schema import RecipeConfig
from hpctoolkit.slurm.render import load_for_render


def slurm_cfg(
    *,
    engines: int = 2,
    nnodes: int = 2,
    engine_gpus: int = 8,
    pp: int = 2,
    gpn: int = 8,
    trainer_nodes: int = 1,
    world: int = 8,
    nodes: int | None = None,
) -> RecipeConfig:
    cfg = RecipeConfig()
    cfg.engine.num_engines = engines
    cfg.engine.nnodes = nnodes
    cfg.engine.gpus_per_node = engine_gpus
    cfg.engine.pp_size = pp
    cfg.training.world_size = world
    cfg.training.device = "cuda"
    c = cfg.cluster
    c.backend = "slurm"
    c.gpus_per_node = gpn
    c.trainer_nodes = trainer_nodes
    c.nodes = trainer_nodes + engines * nnodes if nodes is None else nodes
    return cfg


def check_invariants(plan: Plan, shared: bool = False) -> None:
    """`shared`: the trainers run on engine nodes (cluster.trainer_placement=engine_nodes)."""
    procs = plan.processes()
    # Every GPU of every node is used at most once, and exists.
    used = [(p.node, g) for p in procs for g in p.gpus]
    assert len(used) == len(set(used))
    assert all(0 <= g < plan.gpus_per_node for _, g in used)
    assert all(0 <= p.node < plan.num_nodes for p in procs)
    # Node counts add up: every node hosts something, engines own their nodes exclusively.
    assert {p.node for p in procs} == set(range(plan.num_nodes))
    engine_nodes = [n.node for e in plan.engines for n in e.nodes]
    assert len(engine_nodes) == len(set(engine_nodes))
    if shared:
        assert set(plan.trainer.nodes) <= set(engine_nodes) and plan.num_nodes == len(engine_nodes)
    else:
        assert not set(engine_nodes) & set(plan.trainer.nodes)
        assert plan.num_nodes == len(engine_nodes) + len(plan.trainer.nodes)
    assert plan.total_gpus == len(used)
    assert plan.allocated_gpus == plan.num_nodes * plan.gpus_per_node
    for e in plan.engines:
        assert e.leader.node_rank == 0 and e.leader.role == ROLE_ENGINE_LEADER
        assert [n.node_rank for n in e.nodes] == list(range(e.nnodes))
        assert all(n.role == ROLE_ENGINE_FOLLOWER for n in e.followers)
        assert e.tp * e.pp == e.world_size == sum(len(n.gpus) for n in e.nodes)
        # vLLM's rank order: stages ascend over node_rank then GPU; every stage has tp ranks.
        flat = [s for n in e.nodes for s in n.stages]
        assert flat == sorted(flat)
        assert all(flat.count(s) == e.tp for s in range(e.pp))
    t = plan.trainer
    assert [r.rank for r in t.ranks] == list(range(t.world_size))
    for node in t.nodes:
        mine = [r for r in t.ranks if r.node == node]
        assert [r.local_rank for r in mine] == list(range(t.ranks_per_node))
        # After the engine's GPUs when they share a node.
        first = max(len(n.gpus) for e in plan.engines for n in e.nodes) if shared else 0
        assert [r.gpu for r in mine] == list(range(first, first + t.ranks_per_node))
    assert plan.master is not None and plan.master.node == t.nodes[0]
    # A control-plane record: JSON-ready, stable digest, one describe row per engine node.
    d = plan.to_dict()
    json.dumps(d)
    assert d["totals"]["nodes"] == plan.num_nodes and d["totals"]["gpus"] == plan.total_gpus
    assert plan.digest() == plan.digest() and len(plan.digest()) == 16
    text = plan.describe()
    assert text.count(ROLE_ENGINE_LEADER) == len(plan.engines)
    assert text.count(ROLE_ENGINE_FOLLOWER) == sum(e.nnodes - 1 for e in plan.engines)
    # No fixed port: each rendezvous is picked at start and recorded (`plan.ports`).
    multi = [e for e in plan.engines if e.nnodes > 1]
    assert text.count(PICKED) == len(multi) + (t.world_size > 1) + bool(plan.master and not plan.master.port)
    for e in multi:
        assert f"ports/{engine_listener(e.index)}.json" in text


def test_reference_k3_deployment():
    plan = make_plan(slurm_cfg())
    check_invariants(plan)
    assert (plan.num_nodes, plan.total_gpus, plan.idle_gpus) == (5, 40, 0)
    assert (plan.engine_gpus, plan.trainer_gpus) == (32, 8)
    assert len(plan.engines) == 2
    for e in plan.engines:
        assert (e.nnodes, e.tp, e.pp) == (2, 8, 2)
        assert e.leader.stages == (0,) * 8 and e.leader.gpus == tuple(range(8))
        assert [f.stages for f in e.followers] == [(1,) * 8]
    assert [[n.node for n in e.nodes] for e in plan.engines] == [[1, 2], [3, 4]]
    assert plan.trainer.nodes == (0,) and plan.trainer.world_size == 8
    # Ports are picked at start (two jobs may share a node); the master's goes in master.json.
    assert plan.master.node == 0 and plan.master.port == 0
    # Loopback is useless across nodes: the master binds its node's data-plane address.
    assert plan.master.bind_host is None
    assert "bind data-plane address of its node, port picked at start" in plan.describe()
    assert "trainer rendezvous: data-plane address of n0, port picked at start (ports/trainers.json)" in (
        plan.describe()
    )
    roles = [p.role for p in plan.on_node(0)]
    assert roles == [ROLE_MASTER] + [ROLE_TRAINER] * 8
    assert plan.max_processes_per_node() == 9


def test_k3_recipe_is_the_reference_deployment():
    cfg, missing = load_for_render("recipes/k3.yaml")
    assert missing == ["data.prompts", "paths.output_dir", "paths.target_model"]
    assert make_plan(cfg).to_dict() == make_plan(slurm_cfg()).to_dict()
    plan = make_plan(cfg)
    assert (plan.num_nodes, plan.total_gpus) == (5, 40)
    assert cfg.store.enable_hard_pin and cfg.store.kv_lease_ttl_s == 180
    assert cfg.store.get_retry_max_wait_seconds == 180 and cfg.store.global_segment_size == 128 << 30
    assert cfg.training.num_anchors == 512 and cfg.training.epochs == 1
    assert cfg.training.min_loss_tokens == 14 and cfg.training.fsdp_mode == "full_shard"


def test_k3_engine_layers_match_the_draft():
    cfg, _ = load_for_render("recipes/k3.yaml")
    draft = json.loads(Path(cfg.draft.config).read_text())
    assert list(cfg.engine.target_layer_ids) == draft["target_layer_ids"]


def _pp_choices(world: int, gpn: int):
    for pp in range(1, world + 1):
        if world % pp:
            continue
        tp = world // pp
        if tp % gpn == 0 or gpn % tp == 0:
            yield pp


@pytest.mark.parametrize(("engines", "nnodes"), list(itertools.product((1, 2, 3), (1, 2, 3))))
def test_sweep_slurm(engines, nnodes):
    """Every valid (GPUs per node, PP, trainer nodes, ranks per node) for this engine shape."""
    cases = 0
    for gpn, tnodes in itertools.product((1, 2, 4, 8), (1, 2)):
        for pp in _pp_choices(nnodes * gpn, gpn):
            for per_node in sorted({1, gpn // 2 or 1, gpn}):
                cfg = slurm_cfg(
                    engines=engines,
                    nnodes=nnodes,
                    engine_gpus=gpn,
                    pp=pp,
                    gpn=gpn,
                    trainer_nodes=tnodes,
                    world=per_node * tnodes,
                )
                plan = make_plan(cfg)
                check_invariants(plan)
                assert plan.num_nodes == tnodes + engines * nnodes
                assert plan.engine_gpus == engines * nnodes * gpn
                assert plan.trainer_gpus == per_node * tnodes
                cases += 1
    assert cases >= 40


@pytest.mark.parametrize(("engine_gpus", "gpn"), [(2, 8), (4, 8), (1, 4)])
def test_engines_on_part_of_a_node_leave_the_rest_idle(engine_gpus, gpn):
    plan = make_plan(slurm_cfg(engines=1, nnodes=2, engine_gpus=engine_gpus, pp=2, gpn=gpn, world=gpn))
    check_invariants(plan)
    assert plan.idle_gpus == 2 * (gpn - engine_gpus)
    assert "idle" in plan.describe()


def test_tp_spanning_whole_nodes():
    # TP=16 over two 8-GPU nodes, one stage: both nodes serve stage 0.
    plan = make_plan(slurm_cfg(engines=1, nnodes=2, pp=1))
    assert [n.pp_stages for n in plan.engines[0].nodes] == [(0,), (0,)]
    # TP=4 x PP=4 on two nodes: each node serves two stages.
    plan = make_plan(slurm_cfg(engines=1, nnodes=2, pp=4))
    assert [n.pp_stages for n in plan.engines[0].nodes] == [(0, 1), (2, 3)]


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"nodes": 8}, "cluster.nodes=8"),  # the "8 nodes" reading: three idle nodes refused
        ({"nodes": 4}, "cluster.nodes=4"),
        ({"engine_gpus": 8, "gpn": 4}, "engine.gpus_per_node=8"),
        ({"world": 12, "trainer_nodes": 1}, "training.world_size=12"),
        ({"world": 9, "trainer_nodes": 2}, "training.world_size=9"),
        ({"engines": 1, "nnodes": 3, "pp": 2}, "engine.pp_size=2"),  # TP=12 straddles 8-GPU nodes
    ],
)
def test_refusals_name_the_key(kwargs, key):
    with pytest.raises(ConfigError) as err:
        make_plan(slurm_cfg(**kwargs))
    assert key in str(err.value)


def test_pp_must_divide_the_engine_world_is_the_engine_sections_rule():
    # One place for the rule: the engine section's validate(), which every recipe load runs.
    with pytest.raises(
        ConfigError, match=r"pp_size must divide the engine world size nnodes\*gpus_per_node=8, got 3"
    ):
        slurm_cfg(engines=1, nnodes=1, pp=3).engine.validate()


def test_nodes_message_says_what_to_set():
    with pytest.raises(ConfigError, match=r"set cluster.nodes=5"):
        make_plan(slurm_cfg(nodes=8))


def test_slurm_cpu_trainers_take_no_gpus():
    cfg = slurm_cfg()
    cfg.training.device = "cpu"
    plan = make_plan(cfg)
    assert plan.trainer_gpus == 0
    assert all(r.gpu is None for r in plan.trainer.ranks)
    assert all(p.gpus == () for p in plan.processes() if p.role == "trainer")
    # Not bounded by the node's GPUs: gloo ranks, as many per node as the recipe asks.
    cfg.training.world_size = 3 * cfg.cluster.gpus_per_node * cfg.cluster.trainer_nodes
    assert make_plan(cfg).trainer.ranks_per_node == 3 * cfg.cluster.gpus_per_node


def test_external_master_runs_no_master_process():
    cfg = slurm_cfg()
    cfg.store.master_address = "10.1.2.3:7000"
    plan = make_plan(cfg)
    assert plan.master is None and plan.external_master == "10.1.2.3:7000"
    assert ROLE_MASTER not in {p.role for p in plan.processes()}
    assert "external at 10.1.2.3:7000" in plan.describe()


def test_explicit_bind_and_port_are_kept():
    cfg = slurm_cfg()
    cfg.store.bind_host = "10.0.0.5"
    cfg.store.master_port = 7777
    m = make_plan(cfg).master
    assert (m.bind_host, m.port) == ("10.0.0.5", 7777)


def test_local_plan_everything_on_localhost():
    cfg = RecipeConfig()
    cfg.engine.num_engines = 2
    cfg.engine.nnodes = 2
    cfg.engine.gpus_per_node = 1
    cfg.engine.pp_size = 2
    cfg.training.world_size = 2
    plan = make_plan(cfg)
    assert plan.backend == "local" and plan.hosts == (LOCALHOST,) and plan.num_nodes == 1
    assert {p.node for p in plan.processes()} == {0}
    slots = [g for e in plan.engines for n in e.nodes for g in n.gpus]
    assert slots == [0, 1, 2, 3]
    assert all(r.gpu is None for r in plan.trainer.ranks)  # CPU trainers own no device
    assert plan.master.bind_host == "127.0.0.1" and plan.master.port == 0
    assert "localhost" in plan.describe()


def test_local_cuda_trainers_draw_from_the_same_pool():
    cfg = RecipeConfig()
    cfg.training.world_size = 2
    cfg.training.device = "cuda"
    cfg.cluster.gpus_per_node = 3
    plan = make_plan(cfg)
    assert [r.gpu for r in plan.trainer.ranks] == [1, 2]
    cfg.cluster.gpus_per_node = 2
    with pytest.raises(ConfigError, match=r"cluster\.gpus_per_node=2"):
        make_plan(cfg)


def test_local_recipe_plans():
    from hpctoolkit.recipe.load import load_recipe

    plan = make_plan(load_recipe("recipes/tiny.yaml"))
    assert plan.backend == "local" and len(plan.engines) == 1 and plan.trainer.world_size >= 1


def test_digest_changes_with_placement():
    a = make_plan(slurm_cfg()).digest()
    b = make_plan(slurm_cfg(engines=1, nodes=3)).digest()
    assert a != b


def test_placement_and_slurm_env_import_nothing_heavy():
    """Pure rooms: no torch, vLLM, Mooncake, submitit, not even subprocess."""
    import subprocess
    import sys

    code = (
        "import sys, hpctoolkit.plan.placement, hpctoolkit.slurm.env\n"
        "bad = [m for m in ('torch', 'vllm', 'mooncake', 'submitit', 'subprocess', 'omegaconf') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_k3_recipe_loads_once_its_paths_are_given(tmp_path):
    """The couplings hold for K3: the draft's layers, hidden size, min_loss_tokens, node counts."""
    from hpctoolkit.recipe.load import load_recipe

    target = tmp_path / "kimi-k3"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 61, "hidden_size": 7168}))
    cfg = load_recipe(
        "recipes/k3.yaml",
        [
            f"paths.output_dir={tmp_path / 'run'}",
            f"paths.target_model={target}",
            "data.prompts=/data/p.jsonl",
        ],
    )
    assert make_plan(cfg).to_dict() == make_plan(slurm_cfg()).to_dict()


@pytest.mark.parametrize("port", [29500, 29600, 50051])
def test_named_ports_are_kept_and_the_others_are_picked(port):
    """A port the recipe names is used as given; no rendezvous has a fixed one it could clash
    with (the old fixed 29500 / 29600 no longer exist)."""
    cfg = slurm_cfg(engines=1, nnodes=1, pp=1, trainer_nodes=1, nodes=2)
    cfg.store.master_port = port
    plan = make_plan(cfg)
    assert plan.master is not None and plan.master.port == port
    assert f"port {port}" in plan.master.rule


def test_master_and_metrics_on_one_port_are_refused():
    cfg = slurm_cfg(engines=1, nnodes=1, pp=1, trainer_nodes=1, nodes=2)
    cfg.store.master_port = cfg.store.metrics_port = 50051
    with pytest.raises(ConfigError, match=r"store.metrics_port=50051"):
        make_plan(cfg)


def _shared(**kw):
    """Trainers on engine nodes (cluster.trainer_placement=engine_nodes)."""
    nodes = kw.pop("nodes", None)
    cfg = slurm_cfg(**kw)
    cfg.cluster.trainer_placement = "engine_nodes"
    cfg.cluster.nodes = cfg.engine.num_engines * cfg.engine.nnodes if nodes is None else nodes
    return cfg


@pytest.mark.parametrize("engines", [1, 2, 3])
@pytest.mark.parametrize(
    ("nnodes", "engine_gpus", "pp"), [(1, 4, 1), (2, 4, 2), (4, 4, 2), (2, 6, 1), (4, 2, 4)]
)
@pytest.mark.parametrize("gpn", [5, 8])
def test_trainers_on_engine_nodes_use_the_gpus_the_engines_leave(engines, nnodes, engine_gpus, pp, gpn):
    if engine_gpus >= gpn:
        return
    free = gpn - engine_gpus
    total = engines * nnodes
    for trainer_nodes in range(1, total + 1):
        for per_node in range(1, free + 1):
            cfg = _shared(
                engines=engines,
                nnodes=nnodes,
                engine_gpus=engine_gpus,
                pp=pp,
                gpn=gpn,
                trainer_nodes=trainer_nodes,
                world=per_node * trainer_nodes,
            )
            plan = make_plan(cfg)
            check_invariants(plan, shared=True)
            assert plan.num_nodes == total
            assert plan.trainer.nodes == tuple(range(trainer_nodes))
            for r in plan.trainer.ranks:
                assert engine_gpus <= r.gpu < gpn
            assert plan.master is not None and plan.master.node == 0


def test_trainers_on_engine_nodes_refusals():
    with pytest.raises(ConfigError, match=r"leaves 1 beside engine.gpus_per_node=4"):
        make_plan(_shared(engines=2, nnodes=4, engine_gpus=4, gpn=5, trainer_nodes=4, world=8))
    with pytest.raises(ConfigError, match=r"cluster.trainer_nodes=9 exceeds the 8 engine node"):
        make_plan(_shared(engines=2, nnodes=4, engine_gpus=4, gpn=5, trainer_nodes=9, world=9))
    with pytest.raises(
        ConfigError, match=r"cluster.nodes=9 is more than the placement uses.*set cluster.nodes=8"
    ):
        make_plan(_shared(engines=2, nnodes=4, engine_gpus=4, gpn=5, trainer_nodes=8, world=8, nodes=9))
    with pytest.raises(ConfigError, match=r"trainer_placement must be one of"):
        ClusterConfig(trainer_placement="anywhere").validate()
    with pytest.raises(ConfigError, match=r"host_memory_per_worker must be a size"):
        ClusterConfig(host_memory_per_worker="lots").validate()
