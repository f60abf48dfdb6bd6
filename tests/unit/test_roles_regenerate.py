"""A follower node's part in its leader's regeneration (`roles.engines._follow_generation`): it
waits for this attempt's `regenerated` record, ignores an earlier attempt's records, and leaves at
once, naming the leader's error, when the leader fails while generating. The generating engine
itself is faked here; tests/e2e/test_multihost.py runs the real one over two emulated hosts."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import ClassVar

import pytest

from hpctoolkit.engine.kwargs import run_prefix
from hpctoolkit.errors import DataIntegrityError
from hpctoolkit.plan.placement import make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.roles import engines
from hpctoolkit.rundir.atomic import write_json_atomic
from hpctoolkit.rundir.layout import RunDir

RECIPE = "tests/recipes/multihost.yaml"


@pytest.fixture
def ctx(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cfg = load_recipe(RECIPE, [f"data.prompts={rows}", "data.num_samples=4", "data.regenerate_tokens=8"])
    run = RunDir.of(tmp_path / "out", "multihost-j7").create()
    run.manifests.mkdir(parents=True, exist_ok=True)
    run.logs.mkdir(parents=True, exist_ok=True)
    plan = make_plan(cfg)
    follower = next(p for p in plan.processes() if p.role == "engine-follower")
    return SimpleNamespace(
        cfg=cfg, plan=plan, run=run, run_id=run.run_id, slurm=None, nodename="host4"
    ), follower


class FakeChild:
    """Stands in for the headless follower's process: alive until `leave` is set."""

    instances: ClassVar[list[FakeChild]] = []

    def __init__(self, name, fn, args, workdir):
        self.leave = threading.Event()
        self.killed = False
        FakeChild.instances.append(self)

    def alive(self):
        return not self.leave.is_set() and not self.killed

    @property
    def proc(self):
        return SimpleNamespace(join=lambda t=None: time.sleep(min(t or 0, 0.05)))

    def result(self, timeout=None, linger_s=None):
        return {"left": True}

    def kill_tree(self):
        self.killed = True


@pytest.fixture(autouse=True)
def fakes(monkeypatch):
    import hpctoolkit.engine.regenerate as regen

    FakeChild.instances.clear()
    monkeypatch.setattr(engines, "Child", FakeChild)
    monkeypatch.setattr(engines, "generation_node_args", lambda ctx, proc: None)
    monkeypatch.setattr(regen, "generation_kwargs", lambda cfg, target, node: ({}, {}))


def _prefix(c) -> str:
    return run_prefix(c.run_id, 0)


def test_the_follower_joins_the_capture_once_this_attempts_leader_regenerated(ctx):
    c, proc = ctx
    # An earlier attempt's records do not count.
    write_json_atomic(c.run.regenerated(0), {"run_prefix": "multihost-j6-e0"})
    write_json_atomic(c.run.queue_failed(0), {"run_prefix": "multihost-j6-e0", "error": "old"})

    def leader():
        time.sleep(0.3)
        FakeChild.instances[0].leave.set()
        time.sleep(0.3)
        write_json_atomic(c.run.regenerated(0), {"run_prefix": _prefix(c)})

    t = threading.Thread(target=leader)
    t.start()
    t0 = time.monotonic()
    engines._follow_generation(c, proc, "/nonexistent", threading.Event())
    t.join()
    assert 0.5 < time.monotonic() - t0 < 5


def test_a_leader_failing_while_generating_ends_its_follower_naming_the_error(ctx):
    c, proc = ctx

    def leader():
        time.sleep(0.3)
        write_json_atomic(
            c.run.queue_failed(0), {"run_prefix": _prefix(c), "error": "DataIntegrityError: 3 of 4 bad"}
        )

    threading.Thread(target=leader).start()
    with pytest.raises(
        DataIntegrityError, match=r"leader stopped while generating \(error: DataIntegrityError: 3 of 4 bad\)"
    ):
        engines._follow_generation(c, proc, "/nonexistent", threading.Event())
    assert FakeChild.instances[0].killed


def test_an_ended_step_stops_the_follower_at_once(ctx):
    c, proc = ctx
    stop = threading.Event()
    stop.set()
    with pytest.raises(DataIntegrityError, match="step ended"):
        engines._follow_generation(c, proc, "/nonexistent", stop)


def test_only_engines_with_rows_regenerate(ctx):
    c, _ = ctx
    assert engines.regenerates(c.cfg, 0)
    assert not engines.regenerates(load_recipe(RECIPE, []), 0)
