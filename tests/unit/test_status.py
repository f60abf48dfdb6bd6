"""`python -m hpctoolkit.status`: the phase, progress and failure of a run, from hand-made run
directories holding the records each role writes (every phase, every failure), and the CLI's edges."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hpctoolkit.errors import ConfigError
from hpctoolkit.plan.lifecycle import PHASE_NAMES
from hpctoolkit.rundir.layout import RunDir
from hpctoolkit.status import DONE, FAILED, PREEMPTED, RUNNING, find_run, main, read_records, report

REPO = Path(__file__).resolve().parents[2]
NOW = 1_000_000.0


def make_run(
    tmp_path: Path, *, engines: int = 1, evaluate: bool = True, backend: str = "local", external: bool = False
) -> RunDir:
    run = RunDir.of(tmp_path / "runs", "tiny-20261204-120000-ab12").create()
    cfg = {
        "name": "tiny",
        "data": {"num_samples": 12},
        "engine": {"num_engines": engines},
        "store": {"master_address": "10.0.0.1:50051" if external else None},
        "training": {"steps": 20},
        "cluster": {"backend": backend},
        "evaluate": {"enabled": evaluate},
    }
    run.config.write_text(yaml.safe_dump(cfg))
    return run


def put(path: Path, record: object = None, text: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text is not None else json.dumps(record))


def status(run: RunDir):
    return report(read_records(run), NOW)


def master_up(run: RunDir) -> None:
    put(run.log("master"), text="[hpctoolkit.master] Mooncake master at 127.0.0.1:50051\n")
    put(run.master_record, {"run_id": run.run_id, "address": "127.0.0.1:50051", "metrics_address": "x"})


def training(run: RunDir, step: int = 8) -> None:
    master_up(run)
    put(run.queue(0), text="".join(json.dumps({"sample_key": f"k{i}"}) + "\n" for i in range(5)))
    record = {
        "role": "trainer",
        "step": step,
        "total": 20,
        "loss": 3.6420051,
        "tau": 2.0,
        "samples_per_s": 1.5,
    }
    put(run.progress("trainer"), {**record, "tokens_per_s": 321.4, "eta_s": 8.1, "time": NOW - 4})


def trained(run: RunDir) -> None:
    training(run, 20)
    put(run.queue_done(0), {"run_prefix": "p", "published": 12})
    put(run.drained, {"run_id": run.run_id})
    put(run.summary, {"steps_trained": 20, "final_loss": 3.6420051, "acceptance_length": 1.23456})
    put(run.ended, {"ok": True})


def closed(run: RunDir, engines: int = 1) -> None:
    for e in range(engines):
        put(run.engine_closed(e), {"run_id": run.run_id})


def line(rep, head: str) -> str:
    found = [x for x in rep.lines if x.startswith(head)]
    assert len(found) == 1, rep.lines
    return found[0]


def test_a_fresh_run_directory_is_at_its_start(tmp_path):
    run = make_run(tmp_path)
    put(run.attempt, {"job_id": "7", "restart": 0, "resume_step": None})
    rep = status(run)
    assert (rep.phase, rep.state, rep.role) == ("start", RUNNING, None)
    assert (
        line(rep, "phases")
        == "phases   [start] > master > engines > trainers > drain > evaluate > stop > end"
    )


def test_the_master_phase_until_its_record_then_the_engines(tmp_path):
    run = make_run(tmp_path)
    put(run.log("master"), text="starting\n")
    assert status(run).phase == "master"
    master_up(run)
    rep = status(run)
    assert rep.phase == "engines" and rep.state == RUNNING
    assert not [x for x in rep.lines if x.startswith("trainer")]


def test_an_external_master_skips_the_master_phase(tmp_path):
    run = make_run(tmp_path, external=True)
    put(run.log("engine0"), text="up\n")
    assert status(run).phase == "engines"


def test_the_trainers_phase_shows_step_loss_rates_eta_and_the_records_age(tmp_path):
    run = make_run(tmp_path)
    training(run)
    rep = status(run)
    assert (rep.phase, rep.state) == ("trainers", RUNNING)
    assert line(rep, "trainer") == (
        "trainer  step 8/20 (40%), loss 3.642, tau 2.000, 1.5 samples/s, 321 tokens/s, ETA 8s; reported 4s ago"
    )
    assert line(rep, "engines") == "engines  5 of 12 samples published; 0/1 engine(s) done capturing"
    assert "[trainers]" in line(rep, "phases")
    later = report(read_records(run), NOW + 100)  # ten intervals of the default 10 s, and more
    assert line(later, "trainer").endswith(
        "reported 1m44s ago (nothing for 10 intervals of 10.0s: is the job still running?)"
    )


def test_steps_show_before_the_first_progress_record(tmp_path):
    run = make_run(tmp_path)
    master_up(run)
    put(run.train_files.order_log(0), text='{"step": 1}\n{"step": 2}\n')
    rep = status(run)
    assert rep.phase == "trainers"
    assert line(rep, "trainer") == "trainer  step 2/20 (no progress record yet)"


def test_drain_then_evaluate_then_stop_then_end(tmp_path):
    run = make_run(tmp_path, engines=2)
    trained(run)
    closed(run, 1)
    assert status(run).phase == "drain"
    closed(run, 2)
    rep = status(run)
    assert rep.phase == "evaluate" and rep.state == RUNNING
    assert "2/2 closed" in line(rep, "engines") and "drained" in line(rep, "engines")
    put(
        run.progress("evaluate"), {"role": "evaluate", "what": "questions", "done": 3, "total": 8, "eta_s": 5}
    )
    assert line(status(run), "evaluate") == "evaluate questions 3/8 (37%), ETA 5s"
    put(run.evaluate, {"served_acceptance_length": 1.0980891719745223, "eval_set": "held_out"})
    put(
        run.summary,
        {"steps_trained": 20, "final_loss": 3.6420051, "served_acceptance_length": 1.0980891719745223},
    )
    rep = status(run)
    assert rep.phase == "stop"  # the launcher stops the master, then adds its wall time
    assert line(rep, "evaluate") == "evaluate served acceptance length 1.098 on held_out"
    summary = json.loads(run.summary.read_text()) | {
        "wall_seconds": 312.44,
        "served_k": 3,
        "acceptance_length": 1.2,
    }
    put(run.summary, summary)
    rep = status(run)
    assert (rep.phase, rep.state, rep.role) == ("end", DONE, None)
    assert line(rep, "phase ") == (
        "phase    end: done in 312.4s; 20 steps, final loss 3.642; trainer acceptance length 1.200; "
        "served 1.098 at k=3"
    )
    assert line(rep, "phases").endswith("> stop > [end]")


def test_a_batch_job_without_evaluate_ends_with_its_summary(tmp_path):
    run = make_run(tmp_path, evaluate=False, backend="slurm")
    trained(run)
    closed(run)
    rep = status(run)
    assert (rep.phase, rep.state) == ("end", DONE)
    assert "done in" not in line(rep, "phase ")


def test_a_failed_engine_is_named_with_its_phase_error_and_log(tmp_path):
    run = make_run(tmp_path)
    training(run, 3)
    put(run.queue_failed(0), {"run_prefix": "p", "error": "StoreError: put failed"})
    put(run.log("engine0"), text="[hpctoolkit.engine0] up\nerror: StoreError: put failed\n")
    os.utime(run.log("engine0"), (NOW + 5, NOW + 5))
    rep = status(run)
    assert (rep.phase, rep.state, rep.role) == ("trainers", FAILED, "engine0")
    assert line(rep, "phase ") == "phase    trainers: FAILED in engine0: StoreError: put failed"
    assert line(rep, "log") == f"log      {run.log('engine0')}"


def test_the_earliest_failure_is_where_the_run_stopped(tmp_path):
    run = make_run(tmp_path)
    training(run, 3)
    put(run.log("engine0"), text="error: StoreError: the master went away\n")
    put(run.log("trainer0"), text="error: DataIntegrityError: engine 0 failed\n")
    os.utime(run.log("engine0"), (100, 100))
    os.utime(run.log("trainer0"), (200, 200))
    put(run.ended, {"ok": False, "error": "DataIntegrityError: engine 0 failed"})
    rep = status(run)
    assert (rep.phase, rep.state, rep.role) == ("trainers", FAILED, "engine0")


def test_trainers_that_failed_say_so_through_ended(tmp_path):
    run = make_run(tmp_path, backend="slurm")
    training(run, 3)
    put(run.ended, {"ok": False, "error": "FloatingPointError: loss is nan at step 4"})
    rep = status(run)
    assert (rep.phase, rep.state, rep.role) == ("trainers", FAILED, "trainer0")
    assert "loss is nan at step 4" in line(rep, "phase ")


def test_a_preempted_run_says_where_to_resume(tmp_path):
    run = make_run(tmp_path, backend="slurm")
    training(run, 12)
    put(run.ended, {"ok": False, "preempted": True, "step": 12})
    rep = status(run)
    assert (rep.phase, rep.state) == ("trainers", PREEMPTED)
    assert "checkpointed at step 12" in line(rep, "phase ")


def test_a_failed_evaluation(tmp_path):
    run = make_run(tmp_path)
    trained(run)
    closed(run)
    put(run.log("evaluate"), text="[hpctoolkit.evaluate] serving ...\nerror: RoleFailedError: vLLM died\n")
    rep = status(run)
    assert (rep.phase, rep.state, rep.role) == ("evaluate", FAILED, "evaluate")


def test_a_requeued_attempt_is_named(tmp_path):
    run = make_run(tmp_path, backend="slurm")
    put(run.attempt, {"job_id": "42", "restart": 1, "resume_step": 10})
    training(run, 12)
    assert line(status(run), "attempt") == "attempt  1 of job 42 (resumed at step 10)"


def test_every_phase_name_is_the_lifecycles():
    assert set(PHASE_NAMES) >= {"start", "master", "engines", "trainers", "drain", "evaluate", "stop", "end"}


def test_a_run_is_found_from_its_directory_the_latest_link_or_the_output_dir(tmp_path):
    run = make_run(tmp_path)
    assert find_run(run.root) == run
    newer = RunDir.of(run.output_dir, "tiny-20261204-130000-cd34").create()
    newer.config.write_text(run.config.read_text())
    os.utime(run.config, (1, 1))
    run.link_latest()  # latest names the older run (the newer one is still running)
    assert find_run(run.latest) == run
    assert find_run(run.output_dir) == newer


@pytest.mark.parametrize("what", ["missing", "empty", "file"])
def test_not_a_run_directory_is_one_config_error(tmp_path, what):
    path = tmp_path / what
    if what == "empty":
        path.mkdir()
    elif what == "file":
        path.write_text("x")
    with pytest.raises(ConfigError, match="is not a run directory"):
        find_run(path)


def test_the_cli_prints_the_report(tmp_path, capsys):
    run = make_run(tmp_path)
    training(run)
    assert main([str(run.root)]) == 0
    out = capsys.readouterr().out
    assert "phase    trainers" in out and "step 8/20" in out


def test_the_cli_refuses_bad_input_in_one_line_exit_2(tmp_path):
    for args in ([str(tmp_path / "nope")], []):
        r = subprocess.run(
            [sys.executable, "-m", "hpctoolkit.status", *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert r.returncode == 2, r.stderr
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr


def test_the_listeners_addresses_and_picked_ports_are_listed(tmp_path):
    """The master's addresses and every port picked at start (`ports/<listener>.json`): what a
    site fencing the run's listeners, or a user of a shared node, needs to see."""
    run = make_run(tmp_path)
    master_up(run)
    put(run.port_record("trainers"), {"run_id": run.run_id, "address": "10.0.0.4", "port": 40123})
    put(run.port_record("engine0"), {"run_id": run.run_id, "address": "10.0.0.5", "port": 40200})
    lines = status(run).lines
    assert (
        "ports    master 127.0.0.1:50051, master metrics x, engine0 10.0.0.5:40200, trainers 10.0.0.4:40123"
        in lines
    )
