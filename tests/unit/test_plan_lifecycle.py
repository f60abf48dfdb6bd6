"""The run's lifecycle as data (`plan.lifecycle`): every path through the phases, exhaustively."""

from __future__ import annotations

import itertools

import pytest

from hpctoolkit.plan import lifecycle as lc
from hpctoolkit.rundir.ledger import PREEMPTED_EXIT

SHAPES = [lc.RunShape(own_master=m, evaluate=e) for m, e in itertools.product((True, False), repeat=2)]
STATUSES = [0, 1, 3, PREEMPTED_EXIT, 143]


def test_the_names_and_order_are_the_status_command_s():
    assert lc.PHASE_NAMES == ("start", "master", "engines", "trainers", "drain", "evaluate", "stop", "end")
    assert list(lc.BY_NAME) == list(lc.PHASE_NAMES)


def test_one_grace_for_the_engines_and_the_bounds_live_here():
    assert lc.BY_NAME["drain"].bound_s == lc.ENGINES_DRAIN_GRACE_S == 120
    assert lc.BY_NAME["master"].bound_s == lc.MASTER_START_TIMEOUT_S
    assert lc.BY_NAME["stop"].bound_s == lc.STOP_GRACE_S
    # Only the launcher's own waits are bounded here; the trainers and evaluate bound theirs.
    assert lc.BY_NAME["trainers"].bound_s is None and lc.BY_NAME["evaluate"].bound_s is None


def test_every_role_starts_in_one_phase_and_the_services_end_in_order():
    started = [r for p in lc.PHASES for r in p.starts]
    assert len(started) == len(set(started))
    assert started == ["master", "engine-leader", "engine-follower", "trainer", "evaluate"]
    ends = [(p.name, r) for p in lc.PHASES for r in p.ends]
    # The engines before the master: they unmount their segments from it on the way out.
    assert ends == [("drain", "engine-leader"), ("drain", "engine-follower"), ("stop", "master")]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rc", STATUSES)
@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("evaluate_rc", [0, 4])
def test_every_path(shape, rc, late, checkpointed, evaluate_rc):
    seen = lc.Seen(trainers_rc=rc, late=late, checkpointed=checkpointed)
    names, out = lc.walk(shape, seen, evaluate_rc)
    clean = rc == 0 and not late
    want = ["start", "master", "engines", "trainers", "drain", "evaluate", "stop", "end"]
    if not shape.own_master:
        want.remove("master")
    if not (shape.evaluate and clean):
        want.remove("evaluate")
    assert list(names) == want
    assert lc.bound_s("drain", seen) == (lc.ENGINES_DRAIN_GRACE_S if clean else 0)
    preempted = rc == PREEMPTED_EXIT or (rc != 0 and checkpointed)
    if preempted:
        assert out == lc.Outcome(lc.PREEMPTED, None, 0, requeue=True)
    elif rc != 0:
        assert out == lc.Outcome(lc.FAILED, "trainers", rc, requeue=False)
    elif "evaluate" in names and evaluate_rc:
        assert out == lc.Outcome(lc.FAILED, "evaluate", evaluate_rc, requeue=False)
    else:
        assert out == lc.Outcome(lc.OK, None, 0, requeue=False)
    starts = lc.roles_started(names)
    assert ("master" in starts) == shape.own_master
    assert ("evaluate" in starts) == ("evaluate" in names)


def test_no_outcome_before_the_trainers_end():
    with pytest.raises(ValueError, match="trainers"):
        lc.outcome(lc.Seen())


def test_run_shape_of_a_plan():
    class P:
        master = None

    assert lc.RunShape.of(P(), True) == lc.RunShape(own_master=False, evaluate=True)  # type: ignore[arg-type]
