"""A run you can watch: figures rounded on human lines, progress reported at a steady interval (the
trainer's lines and record, on a real tiny CPU training run), and the launcher's live line on a
terminal only."""

from __future__ import annotations

import io
import json
import math
import re

import pytest

from hpctoolkit.output.console import Console, is_progress
from hpctoolkit.output.figures import duration, figure, rate, seconds
from hpctoolkit.roles.results import trainer_acceptance_line
from hpctoolkit.rundir.progress import Counted, Ticker, count_line, trainer_progress_line, write_progress


@pytest.mark.parametrize(
    ("x", "want"),
    [
        (3.642005169251695, "3.642"),
        (1.0980891719745223, "1.098"),
        (2, "2"),
        (None, "-"),
        (True, "True"),
        ("n/a", "n/a"),
        (math.nan, "nan"),
        (-0.0004, "-0.000"),
    ],
)
def test_a_figure_has_three_decimals_and_an_int_none(x, want):
    assert figure(x) == want


def test_seconds_rates_and_durations_read_as_people_compare_them():
    assert seconds(100.04) == "100.0s" and seconds(0.06) == "0.1s" and seconds(None) == "-"
    assert rate(12.345) == "12.3" and rate(1234.5) == "1234" and rate(0.01234) == "0.0123"
    assert rate(None) == "-" and rate(math.inf) == "inf"
    assert [duration(x) for x in (0, 41.6, 60, 185, 3599, 7620, -3)] == [
        "0s",
        "42s",
        "1m00s",
        "3m05s",
        "59m59s",
        "2h07m",
        "0s",
    ]
    assert duration(None) == "-"


def test_trainer_acceptance_line_rounds_through_the_one_helper():
    line = trainer_acceptance_line(
        {
            "acceptance_length": 5.0199999,
            "acceptance_depth": 7,
            "acceptance_length_at_served_k": 3.4,
            "served_k": 3,
        }
    )
    assert line.startswith("trainer acceptance length 5.020 at its depth k=7, 3.400 at the served k=3")


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_ticker_reports_once_per_interval_and_always_at_the_last():
    clock = Clock()
    t = Ticker(10.0, clock)
    assert t.due()  # the first chance
    fired = []
    for step in range(1, 101):  # 100 steps, 0.5 s each: a report every 10 s, and the last
        clock.t += 0.5
        if t.due(last=step == 100):
            fired.append(step)
    assert fired == [20, 40, 60, 80, 100]
    # A fast run (every step within the interval) reports only its last step.
    fast = Ticker(10.0, clock)
    fast.due()
    assert [s for s in range(1, 1001) if fast.due(last=s == 1000)] == [1000]


def test_progress_lines_and_records(tmp_path):
    r = {
        "step": 40,
        "total": 800,
        "loss": 3.6420051,
        "samples_per_s": 12.34,
        "tokens_per_s": 1234.5,
        "eta_s": 95,
        "tau": 1.94,
    }
    assert (
        trainer_progress_line(r)
        == "step 40/800 (5%), loss 3.642, tau 1.940, 12.3 samples/s, 1234 tokens/s, ETA 1m35s"
    )
    assert trainer_progress_line({}) == "step None/None, loss -, tau -, - samples/s, - tokens/s, ETA -"
    assert (
        count_line({"what": "questions", "done": 3, "total": 8, "eta_s": 12.2})
        == "questions 3/8 (37%), ETA 12s"
    )
    assert count_line({"what": "questions", "done": 3, "total": 8, "eta_s": None}) == "questions 3/8 (37%)"
    path = tmp_path / "progress" / "trainer.json"
    write_progress(path, r, now=1234.5)
    assert json.loads(path.read_text()) == {**r, "time": 1234.5}  # full precision in the record


def test_progress_lines_are_known_by_their_count():
    assert is_progress("[hpctoolkit.trainer] step 40/800 (5%), loss 3.642")
    assert is_progress("[hpctoolkit.evaluate] question turns 12/160 (7%)")
    for line in (
        "[hpctoolkit.trainer] trained 20 steps on 12 samples; final loss 3.642",
        "[hpctoolkit.engine0] engine 0 node_rank 0 up in 3.1s",
        "[hpctoolkit] run tiny-1 in /runs/tiny-1",
        "step 4/8 without a tag",
    ):
        assert not is_progress(line), line


def test_the_console_redraws_progress_on_a_terminal_only():
    term = io.StringIO()
    c = Console(term, live=True)
    c.line("  trainer0 | [hpctoolkit.trainer] step 1/4", progress=True)
    c.line("  trainer0 | [hpctoolkit.trainer] step 2/4", progress=True)
    c.line("  trainer0 | [hpctoolkit.trainer] trained 4 steps")
    c.line("  evaluate | [hpctoolkit.evaluate] questions 1/2", progress=True)
    up = "\x1b[1A\x1b[2K"  # over the live line above
    assert term.getvalue() == (
        "  trainer0 | [hpctoolkit.trainer] step 1/4\n"
        f"{up}  trainer0 | [hpctoolkit.trainer] step 2/4\n"
        "  trainer0 | [hpctoolkit.trainer] trained 4 steps\n"
        "  evaluate | [hpctoolkit.evaluate] questions 1/2\n"
    )
    pipe = io.StringIO()  # not a TTY: plain lines, every one
    c = Console(pipe)
    c.line("a", progress=True)
    c.line("b", progress=True)
    c.line("c")
    assert pipe.getvalue() == "a\nb\nc\n"


STEP_LINE = re.compile(
    r"^\[hpctoolkit\.trainer\] step (\d+)/(\d+) \(\d+%\), loss \d+\.\d{3}, tau \d\.\d{3}, .* samples/s, .* tokens/s, ETA "
)


def _train(tmp_path, monkeypatch, capsys, *, steps: int, every_s: float, min_step_s: float):
    from test_train_run import _recipe

    from hpctoolkit.train.run import train
    from hpctoolkit.train.synthetic import SyntheticSamples

    monkeypatch.setenv("HPCTOOLKIT_MIN_STEP_S", str(min_step_s))
    cfg = _recipe("tiny_dflash", tmp_path, steps=steps, progress_every_s=every_s, checkpoint_every=steps)
    cfg.training.export = False
    src = SyntheticSamples(num_samples=8, vocab_size=512, hidden_size=128, num_aux=3, seed=2)
    record = tmp_path / "progress" / "trainer.json"
    capsys.readouterr()
    train(cfg, src, tmp_path / "out", progress_file=record)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[hpctoolkit.trainer] step")]
    return lines, json.loads(record.read_text())


@pytest.mark.timeout(240)
def test_the_trainer_reports_at_its_interval_and_at_the_last_step(tmp_path, monkeypatch, capsys):
    # Paced at 0.25 s a step, a report every 0.6 s: about every third step, and step 10.
    lines, record = _train(tmp_path / "paced", monkeypatch, capsys, steps=10, every_s=0.6, min_step_s=0.25)
    steps = [int(m.group(1)) for m in map(STEP_LINE.match, lines) if m]
    assert len(steps) == len(lines), lines
    assert steps[-1] == 10 and steps == sorted(set(steps)), lines
    # Throttled: fewer lines than steps. (Not "never two steps in a row": on a loaded machine one
    # paced step can itself outlast the interval.)
    assert 2 <= len(steps) <= 6, lines
    assert record["step"] == 10 and record["total"] == 10 and record["role"] == "trainer"
    assert record["loss"] > 0 and record["samples_per_s"] > 0 and record["eta_s"] == 0
    assert record["time"] > 0
    # A fast run within one interval: its last step only, no flood.
    lines, record = _train(tmp_path / "fast", monkeypatch, capsys, steps=6, every_s=1000, min_step_s=0)
    assert [STEP_LINE.match(x).group(1) for x in lines] == ["6"], lines  # type: ignore[union-attr]
    assert record["step"] == 6


def test_a_count_reports_at_its_interval_with_an_eta_from_the_first_unit():
    clock = Clock()
    got: list[dict] = []
    counted = Counted("evaluate", "questions", 8, 10.0, got.append, clock)
    clock.t = 60.0  # the engine's start: no work yet, and not counted against the ETA
    for _ in range(8):
        counted(1)
        clock.t += 4.0
    # The first answer (after the start), then one interval later each time, and the last.
    assert [r["done"] for r in got] == [1, 4, 7, 8]
    assert got[0] == {"role": "evaluate", "what": "questions", "done": 1, "total": 8, "eta_s": None}
    assert got[1]["eta_s"] == 16.0  # 3 answers in 12 s since the first: 4 more take 16 s
    assert got[-1]["eta_s"] == 0


def test_the_trainer_rates_follow_the_recent_intervals_not_the_start(monkeypatch):
    """Slow first steps (compilation, the first samples' wait), then fast ones: the rates and the
    ETA are the recent ones (the H100's `make run` said ETA 4h28m at step 2 of a 9-minute run)."""
    from types import SimpleNamespace

    import hpctoolkit.train.reporter as progress

    got: list[dict] = []
    monkeypatch.setattr(progress, "write_progress", lambda path, record: got.append(record))
    monkeypatch.setattr(progress, "say", lambda line: None)
    clock = Clock()
    prog = progress.TrainProgress(
        family="dflash",
        total=1000,
        start_step=0,
        samples_per_step=16,
        every_s=10.0,
        record="trainer.json",
        bar=False,
        clock=clock,
    )
    stats, window = SimpleNamespace(loss=1.0), SimpleNamespace(total=lambda: None)
    for step in range(1, 1001):
        clock.t += 20.0 if step <= 5 else 0.5  # 5 slow steps, then 2 steps a second
        prog.step(step, stats, {}, 100.0 * step, window)
    assert got[0]["step"] == 2 and got[0]["eta_s"] == pytest.approx(998 * 20.0)
    # Past the slow start the ETA is (steps left) x 0.5 s, the rate 2 steps = 32 samples a second.
    late = [r for r in got if r["step"] > 200]
    assert late
    for r in late:
        assert r["eta_s"] == pytest.approx((1000 - r["step"]) * 0.5, abs=1e-6)
        assert r["samples_per_s"] == pytest.approx(32.0) and r["tokens_per_s"] == pytest.approx(200.0)
    assert got[-1]["step"] == 1000 and got[-1]["eta_s"] == 0
