"""Trainer rank 0's summary, assembled in `rundir.summary` from the run directory's records and a
`TrainerReport` (no role, no store, no training: the records are written by hand)."""

from __future__ import annotations

import json

from hpctoolkit.rundir.atomic import write_json_atomic
from hpctoolkit.rundir.layout import RunDir
from hpctoolkit.rundir.summary import (
    TrainerReport,
    live_summary,
    offline_summary,
    train_fields,
    write_trainer_summary,
)
from hpctoolkit.rundir.totals import wait_read_totals

RESULT = {
    "steps_trained": 4,
    "steps_this_run": 4,
    "final_loss": 1.5,
    "acceptance_length": 2.0,
    "acceptance_depth": 3,
    "acceptance_length_by_k": {"2": 1.75, "3": 2.0},
    "train_metrics": {"not": "in the summary"},
}


def _report(run: RunDir, **kw) -> TrainerReport:
    return TrainerReport(run, "r", run.run_id, 2, links_latest=False, **kw)


def test_train_fields_take_trainings_own_figures_and_the_served_k():
    fields = train_fields(RESULT, 2)
    assert fields["steps_trained"] == 4 and fields["gpu_busy"] is None
    assert fields["served_k"] == 2 and fields["acceptance_length_at_served_k"] == 1.75
    assert "train_metrics" not in fields
    assert train_fields(None, 3)["served_k"] == 3


def test_an_offline_summary_is_the_recipe_the_run_and_trainings_figures(tmp_path):
    run = RunDir(tmp_path, "r1")
    assert offline_summary(_report(run), RESULT) == {"recipe": "r", "run_id": "r1", **train_fields(RESULT, 2)}


def _live_run(tmp_path, *, read: int) -> tuple[RunDir, TrainerReport]:
    run = RunDir(tmp_path, "r1")
    prefixes = ("r1-e0",)
    write_json_atomic(run.queue_done(0), {"run_prefix": "r1-e0", "published": 6})
    for rank, n in enumerate((read, 0)):
        rec = {"samples": n, "bytes": 10 * n, "complete": True, "prefixes": list(prefixes)}
        write_json_atomic(run.spool_files.read_record(rank), rec)
    write_json_atomic(run.host(0), {"nodename": "a", "address": "10.0.0.1"})
    write_json_atomic(run.host(1), {"nodename": "b", "address": "10.0.0.2"})
    report = _report(
        run,
        world_size=2,
        prefixes=prefixes,
        node_roles=(("engine-leader", "master"), ("trainer",)),
        remote_ranks=(0,),
    )
    return run, report


def test_a_live_summary_counts_what_the_records_say_moved(tmp_path):
    _, report = _live_run(tmp_path, read=6)
    got = live_summary(report, RESULT, drain={"at_s": 1.23}, count_keys=lambda: 0, t0=0.0, read_timeout_s=1)
    assert list(got)[:6] == [
        "recipe",
        "run_id",
        "samples_published",
        "samples_read",
        "bytes_moved",
        "keys_left_in_store",
    ]
    assert (got["samples_published"], got["samples_read"], got["bytes_moved"]) == (6, 6, 60)
    assert got["keys_left_in_store"] == 0 and got["drained_after_s"] == 1.2
    assert got["hosts"]["n1"] == {"host": "b", "address": "10.0.0.2", "roles": ["trainer"]}
    assert got["bytes_across_hosts"] == 60
    assert "train" in got["phases_s"] and "samples_unread" not in got


def test_a_live_summary_names_the_samples_never_read_and_takes_the_watchs_key_count(tmp_path):
    _, report = _live_run(tmp_path, read=4)
    drain = {"keys_left_in_store": 2}
    got = live_summary(report, RESULT, drain=drain, count_keys=lambda: 99, t0=0.0, read_timeout_s=0)
    assert got["samples_unread"] == 2 and got["keys_left_in_store"] == 2 and got["drained_after_s"] is None


def test_the_read_totals_wait_ends_once_every_record_is_complete_or_drained(tmp_path):
    _, report = _live_run(tmp_path, read=4)
    records = report.read_records
    assert wait_read_totals(records, report.prefixes, 6, wait=True, drained=lambda: False, timeout_s=60) == (
        4,
        40,
    )
    write_json_atomic(records[1], {"samples": 1, "bytes": 5, "complete": False, "prefixes": ["r1-e0"]})
    got = wait_read_totals(records, report.prefixes, 6, wait=True, drained=lambda: True, timeout_s=60)
    assert got == (5, 45)
    assert wait_read_totals(
        records, ("another-attempt",), None, wait=False, drained=lambda: False, timeout_s=60
    ) == (0, 0)


def test_the_trainers_last_word_keeps_an_earlier_attempts_figures_and_ends_the_run(tmp_path):
    run = RunDir(tmp_path, "r1")
    run.root.mkdir(parents=True)
    write_json_atomic(run.summary_earlier, {"run_id": "r1", "final_loss": 0.5, "samples_read": 64})
    written = write_trainer_summary(_report(run), {"run_id": "r1", "final_loss": None, "steps_this_run": 2})
    assert written == {"run_id": "r1", "final_loss": 0.5, "steps_this_run": 2, "samples_read": 64}
    assert json.loads(run.summary.read_text()) == written
    assert json.loads(run.ended.read_text()) == {"ok": True}
    assert not run.latest.is_symlink()


def test_the_trainers_end_records_say_failed_or_preempted(tmp_path):
    from hpctoolkit.rundir import ledger

    run = RunDir(tmp_path, "r1")
    run.root.mkdir(parents=True)
    ledger.end_failed(run, ValueError("bad"))
    assert json.loads(run.ended.read_text()) == {"ok": False, "error": "ValueError: bad"}
    assert not ledger.wait_preempted(run, 0)
    ledger.end_preempted(run, 7)
    assert json.loads(run.ended.read_text()) == {"ok": False, "preempted": True, "step": 7}
    assert ledger.wait_preempted(run, 0)
