"""summary.json and `latest` on every backend (`roles.results`): trainer rank 0 writes the summary
and sets `latest` when it is the run's last role; the evaluate role merges its figures in and sets
`latest` after it; submitit's task of trainer rank 0 runs evaluate once its trainer returned 0. The
Slurm environment is faked; nothing is served (vLLM is not started)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import ClassVar

import pytest

from hpctoolkit.errors import RoleFailedError
from hpctoolkit.plan.lifecycle import ENGINES_DRAIN_GRACE_S
from hpctoolkit.plan.placement import make_plan
from hpctoolkit.roles import context, dispatch, evaluate
from hpctoolkit.roles.network import HostAddress
from hpctoolkit.roles.trainer_job import trainer_report
from hpctoolkit.rundir.atomic import write_json_atomic
from hpctoolkit.rundir.summary import write_trainer_summary

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "tests/golden/emulated_3node.yaml"  # evaluate.enabled (the default)


@pytest.fixture(autouse=True)
def _on_node0(monkeypatch):
    monkeypatch.chdir(ROOT)
    for name in ("HPCTOOLKIT_PLAN_DIGEST", "HPCTOOLKIT_NODE_DRY", "HPCTOOLKIT_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node[4-6]")
    monkeypatch.setenv("SLURMD_NODENAME", "node4")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "1")  # trainer rank 0 under submitit
    monkeypatch.setattr(context, "local_address", lambda net, host: HostAddress("eth0", "10.0.0.4"))


def ctx_for(tmp_path, *overrides: str) -> context.NodeContext:
    return context.load_context(RECIPE, [f"paths.output_dir={tmp_path}", *overrides])


def latest(ctx) -> str | None:
    return os.readlink(ctx.run.latest) if ctx.run.latest.is_symlink() else None


@pytest.mark.parametrize(("enabled", "linked"), [("false", True), ("true", False)])
def test_trainer_sets_latest_only_when_it_is_the_last_role(tmp_path, enabled, linked):
    ctx = ctx_for(tmp_path, f"evaluate.enabled={enabled}")
    write_trainer_summary(trainer_report(ctx), {"run_id": ctx.run_id, "steps_trained": 3})
    assert json.loads(ctx.run.summary.read_text())["steps_trained"] == 3
    assert json.loads(ctx.run.ended.read_text()) == {"ok": True}
    assert latest(ctx) == (ctx.run_id if linked else None)


def test_a_by_hand_resume_of_a_finished_run_keeps_its_figures(tmp_path):
    """The finished run's summary (its trainer's and its evaluation's figures) was set aside when
    the new attempt began (`ledger.begin_attempt`); an attempt that trained no step keeps them."""
    from hpctoolkit.rundir import ledger

    ctx = ctx_for(tmp_path, "evaluate.enabled=false")
    earlier = {"run_id": ctx.run_id, "steps_trained": 8, "steps_this_run": 8, "final_loss": 0.25}
    earlier |= {"acceptance_length": 2.5, "served_acceptance_length": 2.25, "samples_read": 64}
    write_json_atomic(ctx.run.summary, earlier)
    ledger.begin_attempt(ctx.run, "43", 0)
    assert not ctx.run.summary.exists()
    write_trainer_summary(
        trainer_report(ctx),
        {
            "run_id": ctx.run_id,
            "steps_trained": 8,
            "steps_this_run": 0,
            "final_loss": None,
            "acceptance_length": None,
            "samples_read": 0,
            "keys_left_in_store": 0,
        },
    )
    summary = json.loads(ctx.run.summary.read_text())
    assert {k: summary[k] for k in earlier if k != "steps_this_run"} == {
        k: v for k, v in earlier.items() if k != "steps_this_run"
    }
    assert summary["steps_this_run"] == 0 and summary["keys_left_in_store"] == 0


def test_a_resume_that_trains_keeps_its_own_figures_and_the_earlier_ones_it_lacks():
    from hpctoolkit.rundir.summary import carry_forward

    earlier = {"final_loss": 0.5, "served_acceptance_length": 2.0, "steps_this_run": 4}
    new = {"final_loss": 0.25, "served_acceptance_length": None, "steps_this_run": 4, "resumed_from_step": 4}
    assert carry_forward(new, earlier) == {**new, "served_acceptance_length": 2.0}
    assert carry_forward(new, None) == new


def test_evaluate_merges_into_the_summary_and_sets_latest(tmp_path, monkeypatch):
    ctx = ctx_for(tmp_path)
    with pytest.raises(RoleFailedError, match=r"summary\.json is missing"):
        evaluate.run_evaluate(ctx)
    write_json_atomic(ctx.run.summary, {"run_id": ctx.run_id, "steps_trained": 3})
    monkeypatch.setattr(evaluate, "not_served_reason", lambda draft: "no GPU here")
    assert evaluate.run_evaluate(ctx) == 0
    summary = json.loads(ctx.run.summary.read_text())
    result = json.loads(ctx.run.evaluate.read_text())
    assert summary["steps_trained"] == 3 and summary["served_acceptance_skipped"] == "no GPU here"
    assert {k: summary[k] for k in result} == result
    assert latest(ctx) == ctx.run_id


def test_evaluate_is_dry_when_the_trainers_are(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HPCTOOLKIT_NODE_DRY", "engine-leader,trainer")
    ctx = ctx_for(tmp_path)
    assert evaluate.run_evaluate(ctx) == 0
    assert "dry: the trainers are dry" in capsys.readouterr().out
    assert not ctx.run.evaluate.exists() and latest(ctx) is None


class FakeChild:
    started: ClassVar[list[tuple]] = []

    def __init__(self, name, fn, args, workdir):
        FakeChild.started.append((name, fn, args, workdir))

    def result(self):
        return 0


@pytest.mark.parametrize(
    ("localid", "enabled", "code", "evaluates"),
    [(1, "true", 0, True), (2, "true", 0, False), (1, "false", 0, False), (1, "true", 75, False)],
    ids=["rank0", "rank1", "disabled", "preempted"],
)
def test_submitit_trainer_rank0_runs_evaluate_after_its_trainer(
    tmp_path, monkeypatch, localid, enabled, code, evaluates
):
    monkeypatch.setenv("SLURM_LOCALID", str(localid))
    overrides = [f"paths.output_dir={tmp_path}", f"evaluate.enabled={enabled}"]
    ctx = context.load_context(RECIPE, overrides)
    monkeypatch.setattr(dispatch, "_begin_attempt", lambda ctx, senv: None)
    monkeypatch.setattr(dispatch, "run_process", lambda ctx, proc, dry: code)
    monkeypatch.setattr(dispatch, "Child", FakeChild)
    drains: list[float] = []
    # Before evaluate, the drain (plan.lifecycle): the engines' close records, within the one grace.
    monkeypatch.setattr(dispatch, "_wait_drained", lambda ctx, bound_s: drains.append(bound_s))
    FakeChild.started = []
    assert dispatch.run_task(make_plan(ctx.cfg), RECIPE, overrides, False) == code
    assert drains == ([ENGINES_DRAIN_GRACE_S] if evaluates else [])
    if evaluates:
        [(name, fn, args, workdir)] = FakeChild.started
        assert (name, fn, workdir) == ("evaluate", evaluate.evaluate_in_fresh_process, ctx.run.logs)
        assert args[:2] == (RECIPE, overrides) and args[2]["SLURM_LOCALID"] == "1"
    else:
        assert FakeChild.started == []


def test_phase_seconds_take_each_phases_slowest_engine_and_keep_what_the_summary_holds(tmp_path):
    from hpctoolkit.rundir.layout import RunDir
    from hpctoolkit.rundir.summary import merge_summary, phase_fields

    run = RunDir(tmp_path, "r1")
    run.logs.mkdir(parents=True)
    write_json_atomic(
        run.logs / "phases-engine0.json", {"regenerate": 120.0, "engine_start": 30.0, "capture": 10.0}
    )
    write_json_atomic(
        run.logs / "phases-engine1.json", {"regenerate": 100.0, "engine_start": 35.5, "capture": 9.0}
    )
    got = phase_fields(run, train=200.04)
    assert got == {"phases_s": {"regenerate": 120.0, "engine_start": 35.5, "capture": 10.0, "train": 200.0}}
    merge_summary(run, got)
    assert phase_fields(run, evaluate=50)["phases_s"] == {**got["phases_s"], "evaluate": 50}
    assert phase_fields(RunDir(tmp_path, "empty")) == {}
