"""The one driver over the lifecycle (`plan.lifecycle.drive`): a fake backend that records its
hooks walks every path `lifecycle.walk` describes, and adding a phase is `plan.lifecycle` plus a
hook in each backend's table: a backend without one (the embedded launcher, a submitit task, the
batch script, the status command) refuses with one line naming the phase, before anything runs.
CPU only, milliseconds."""

from __future__ import annotations

import dataclasses
import itertools
import types
from pathlib import Path

import pytest

from hpctoolkit.plan import lifecycle as lc
from hpctoolkit.plan.placement import make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.rundir.ledger import PREEMPTED_EXIT

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [lc.RunShape(own_master=m, evaluate=e) for m, e in itertools.product((True, False), repeat=2)]
# One more phase: the trainers' export handed to a registry, between the drain and evaluate.
PUBLISH = lc.Phase("publish", "hand the export to a model registry", enter=lc.CLEAN_AND_ENABLED)
WITH_PUBLISH = (*lc.PHASES[:5], PUBLISH, *lc.PHASES[5:])


class Recorder:
    """A backend that records each hook it is asked to run; its trainers end as `seen` says."""

    def __init__(self, seen: lc.Seen, phases: tuple[lc.Phase, ...] = lc.PHASES):
        self.seen, self.calls, self.entered = seen, [], []
        self.table = {p.name: self.hook(p.name) for p in phases}

    def hook(self, name: str) -> lc.Hook:
        def run(seen: lc.Seen) -> lc.Seen | None:
            self.calls.append((name, seen))
            return self.seen if name == "trainers" else None

        return run


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rc", [0, 3, PREEMPTED_EXIT])
@pytest.mark.parametrize("late", [False, True])
def test_the_driver_walks_the_path_walk_describes(shape, rc, late):
    seen = lc.Seen(trainers_rc=rc, late=late)
    rec = Recorder(seen)
    got = lc.drive("recorder", rec.table, shape, rec.entered.append)
    names, _ = lc.walk(shape, seen)
    assert [p.name for p in rec.entered] == [n for n, _ in rec.calls] == list(names)
    assert got == seen
    # Each hook sees what the run saw before it: the trainers' status only after their phase.
    before = [s for n, s in rec.calls if lc.PHASE_NAMES.index(n) <= lc.PHASE_NAMES.index("trainers")]
    assert all(s == lc.Seen() for s in before)


def test_a_backend_with_no_part_in_a_phase_is_not_entered_there():
    rec = Recorder(lc.Seen(trainers_rc=0))
    table = {**rec.table, "master": None, "end": None}
    lc.drive("recorder", table, lc.RunShape(own_master=True, evaluate=False), rec.entered.append)
    assert [p.name for p in rec.entered] == ["start", "engines", "trainers", "drain", "stop"]


def test_adding_a_phase_is_the_lifecycle_plus_a_hook():
    shape = lc.RunShape(own_master=True, evaluate=True)
    for rc, want in ((0, True), (1, False)):
        rec = Recorder(lc.Seen(trainers_rc=rc), WITH_PUBLISH)
        lc.drive("recorder", rec.table, shape, rec.entered.append, phases=WITH_PUBLISH)
        names = [n for n, _ in rec.calls]
        assert ("publish" in names) == want
        if want:
            assert names[names.index("drain") + 1 : names.index("evaluate")] == ["publish"]


def test_a_table_that_misses_a_phase_or_names_none_is_refused_before_any_hook_runs():
    rec = Recorder(lc.Seen(trainers_rc=0))
    with pytest.raises(ValueError, match=r"the recorder backend .*: no hook for phase\(s\) publish;") as err:
        lc.drive("recorder", rec.table, lc.RunShape(True, True), phases=WITH_PUBLISH)
    assert "\n" not in str(err.value) and rec.calls == []
    with pytest.raises(ValueError, match="hooks for no phase: publish"):
        lc.check_hooks("recorder", {**rec.table, "publish": None})


@pytest.fixture
def one_more_phase(monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(lc, "PHASES", WITH_PUBLISH)


NO_PUBLISH = r"the {} backend does not match plan\.lifecycle\.PHASES .*: no hook for phase\(s\) publish;"


def test_the_batch_script_refuses_a_phase_it_cannot_render(one_more_phase, tmp_path):
    from hpctoolkit.slurm.render import render_sbatch

    recipe, ov = "tests/golden/emulated_3node.yaml", [f"paths.output_dir={tmp_path}"]
    cfg = load_recipe(recipe, ov)
    with pytest.raises(ValueError, match=NO_PUBLISH.format("batch-script")):
        render_sbatch(cfg, make_plan(cfg), recipe_path=recipe, overrides=ov)


def test_the_embedded_launcher_refuses_it_before_a_run_directory_exists(one_more_phase, tmp_path):
    from hpctoolkit.roles.local import run_local

    ov = [f"paths.output_dir={tmp_path / 'out'}"]
    cfg = load_recipe("recipes/tiny.yaml", ov)
    with pytest.raises(ValueError, match=NO_PUBLISH.format("embedded")):
        run_local(cfg, make_plan(cfg), "recipes/tiny.yaml", ov, role_argv=lambda role: ["false"])
    assert not (tmp_path / "out").exists()


def test_a_submitit_task_refuses_it_before_the_attempt_starts(one_more_phase, tmp_path):
    from hpctoolkit.roles import dispatch
    from hpctoolkit.slurm.tasks import WATCHER

    cfg = load_recipe("tests/golden/emulated_3node.yaml", [f"paths.output_dir={tmp_path}"])
    ctx = types.SimpleNamespace(cfg=cfg, plan=make_plan(cfg))
    with pytest.raises(ValueError, match=NO_PUBLISH.format("submitit")):
        dispatch.follow(ctx, None, WATCHER, "recipe.yaml", [])  # type: ignore[arg-type]


def test_the_status_command_refuses_it_until_it_knows_the_phase_s_records(one_more_phase, tmp_path):
    from hpctoolkit import status
    from hpctoolkit.rundir.layout import RunDir

    records = status.Records(run=RunDir.of(tmp_path, "r"), config={"evaluate": {"enabled": True}})
    with pytest.raises(ValueError, match=NO_PUBLISH.format("status")):
        status.report(records, 0.0)
    # Its hook: when the new phase's records are there. The run is then in it, after the drain.
    recorded = {**status.RECORDED, "publish": lambda r: False}
    ended = dataclasses.replace(
        records, started=True, master={}, ended={"ok": True}, engines_closed=frozenset({0})
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(status, "RECORDED", recorded)
        got = status.report(ended, 0.0)
    assert got.phase == "publish"
    assert "drain > [publish] > evaluate" in got.lines[2]
