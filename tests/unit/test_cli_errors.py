"""Every failure reaches the user as one line: `run_cli`'s fallback for unexpected errors (traceback
to a file, or stderr with HPCTOOLKIT_DEBUG=1), Ctrl-C, a phase child's failure, and submitit's task
entry, which bypasses `run_cli`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hpctoolkit.cli import run_cli
from hpctoolkit.errors import ConfigError, StoreError
from hpctoolkit.roles import dispatch
from hpctoolkit.roles.child import Child, ChildFailedError


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HPCTOOLKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HPCTOOLKIT_DEBUG", raising=False)


def exits(main, capsys) -> tuple[int, list[str]]:
    with pytest.raises(SystemExit) as done:
        run_cli(main, [])
    err = capsys.readouterr().err
    return done.value.code, [x for x in err.splitlines() if x.strip()]


def raising(err: BaseException):
    def main(argv: list[str]) -> int:
        raise err

    return main


def test_unexpected_error_is_one_line_with_its_traceback_in_a_file(tmp_path, capsys):
    code, lines = exits(raising(FileExistsError(17, "File exists", "/runs/x")), capsys)
    assert code == 1
    assert len(lines) == 1 and "Traceback" not in lines[0]
    assert lines[0].startswith("error: FileExistsError: [Errno 17] File exists: '/runs/x' (traceback in ")
    path = Path(lines[0].rsplit("(traceback in ", 1)[1].rstrip(")"))
    assert path.parent == tmp_path / "cache" / "errors"
    text = path.read_text()
    assert "Traceback (most recent call last)" in text and "FileExistsError" in text


def test_a_message_of_several_lines_is_one_line(capsys):
    code, lines = exits(raising(RuntimeError("first\n  second\nthird")), capsys)
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith("error: RuntimeError: first second third (traceback in ")


def test_debug_prints_the_traceback_before_the_line(monkeypatch, capsys):
    monkeypatch.setenv("HPCTOOLKIT_DEBUG", "1")
    code, lines = exits(raising(ValueError("bad")), capsys)
    assert code == 1
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[-1].startswith("error: ValueError: bad (traceback in ")


def test_known_faults_and_config_errors_keep_their_lines_and_write_nothing(tmp_path, capsys):
    assert exits(raising(StoreError("master 10.0.0.1:50051 did not answer")), capsys) == (
        1,
        ["error: StoreError: master 10.0.0.1:50051 did not answer"],
    )
    assert exits(raising(ConfigError("training.steps must be > 0")), capsys) == (
        2,
        ["error: training.steps must be > 0"],
    )
    assert not (tmp_path / "cache" / "errors").exists()


def test_ctrl_c_exits_130_quietly(capsys):
    assert exits(raising(KeyboardInterrupt()), capsys) == (130, ["interrupted"])


def _fails_with_two_lines() -> None:
    raise ValueError("the shard is short\nby 3 bytes")


def test_a_failed_phase_is_one_line_and_its_traceback_goes_to_the_log(tmp_path, capsys):
    child = Child("capture", _fails_with_two_lines, (), tmp_path)
    with pytest.raises(ChildFailedError) as raised:
        child.result(timeout=120)
    message = str(raised.value)
    assert message == (
        "capture phase failed: ValueError: the shard is short by 3 bytes (its traceback is in this role's log)"
    )
    err = capsys.readouterr().err
    assert "traceback of the capture phase" in err and "_fails_with_two_lines" in err
    # run_cli reports it as a failed role: its one line, no second traceback file.
    code, lines = exits(raising(raised.value), capsys)
    assert (code, lines) == (1, [f"error: ChildFailedError: {message}"])


def test_a_failing_submitit_task_prints_the_line_and_still_fails(monkeypatch, capsys):
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # restored after the test

    def boom(*args):
        raise OSError("No space left on device")

    monkeypatch.setattr(dispatch, "_run_task", boom)
    with pytest.raises(OSError, match="No space left") as raised:
        dispatch.run_task(None, "recipe.yaml", [], False)  # type: ignore[arg-type]
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: OSError: No space left on device (traceback in ")
    # submitit re-raises it out of the task's interpreter: the last-resort hook adds nothing.
    sys.excepthook(OSError, raised.value, raised.value.__traceback__)
    assert capsys.readouterr().err == ""


def test_sigusr1_prints_every_threads_stack_and_the_process_goes_on():
    """A hung role is read with `scancel --signal=USR1 JOB`: its stacks land in the job's log."""
    import signal
    import subprocess
    import sys
    import time

    code = "import time\nfrom hpctoolkit.cli import run_cli\nrun_cli(lambda argv: time.sleep(2) or 0)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "most recent call first" in err and "<lambda>" in err, err
