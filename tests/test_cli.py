"""``python -m poller``: argument errors in-process, a real standalone poller and the demo as subprocesses."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from buffer import ReplayBuffer
from poller.cli import main
from poller.sources.sqlite import SqliteSource
from tests.conftest import wait_until

ROOT = Path(__file__).resolve().parent.parent
SPEC = "poller.sources.sqlite:SqliteSource"


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    """``main(["run", ...])`` calls logging.basicConfig; keep it from leaking into later tests."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers[:]:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {err!r}"
    assert "error" in lines[0]
    assert "Traceback" not in err
    return lines[0]


# -- argument errors, in-process -----------------------------------------------------------------

def test_run_without_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run"]) == 2
    line = _one_error_line(capsys)
    assert "--source" in line or "--connect" in line


def test_no_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    _one_error_line(capsys)


@pytest.mark.parametrize("spec, needle", [
    ("nope", "package.module:attr"),
    ("no_such_module_for_the_cli_test:Thing", "ModuleNotFoundError"),
    ("poller.sources.sqlite:NoSuchThing", "NoSuchThing"),
    ("poller.wire.protocol:PROTOCOL_VERSION", "TypeError"),
])
def test_bad_source_spec_is_one_line(capsys: pytest.CaptureFixture[str], spec: str, needle: str) -> None:
    assert main(["run", "--source", spec, "--connect", "tcp://127.0.0.1:1"]) == 2
    line = _one_error_line(capsys)
    assert spec in line and needle in line


def test_source_factory_failure_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["run", "--source", SPEC, "--source-kwargs", json.dumps({"path": str(tmp_path / "kv.db"),
                                                                          "bogus": 1}),
                 "--connect", "tcp://127.0.0.1:1"])
    assert code == 2
    assert "TypeError" in _one_error_line(capsys)
    assert not (tmp_path / "kv.db").exists()  # the source is lazy and was closed unused


@pytest.mark.parametrize("kwargs", ["{not json", "[1, 2]", "\"path\"", ""])
def test_bad_source_kwargs(capsys: pytest.CaptureFixture[str], kwargs: str) -> None:
    assert main(["run", "--source", SPEC, "--source-kwargs", kwargs, "--connect", "tcp://127.0.0.1:1"]) == 2
    assert "--source-kwargs" in _one_error_line(capsys)


@pytest.mark.parametrize("interval", ["0", "-1", "fast"])
def test_bad_interval(capsys: pytest.CaptureFixture[str], interval: str) -> None:
    assert main(["run", "--source", SPEC, "--connect", "tcp://127.0.0.1:1", "--poll-interval", interval]) == 2
    assert "interval" in _one_error_line(capsys)


def test_a_command_that_moved_says_where_it_went(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--seconds", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m poller demo: error: ") and "python -m buffer.demo" in err
    assert err.count("\n") == 1  # one line, as every bad-input path


def test_bad_demo_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    from buffer.demo import main as demo_main

    assert demo_main(["--writers", "0"]) == 2
    assert "--writers" in _one_error_line(capsys)


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "run" in out and "doctor" in out
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--source" in out and "--connect" in out and "SIGTERM" in out


# -- a real standalone poller over TCP ----------------------------------------------------------

def _wait_for(predicate: Callable[[], bool], proc: subprocess.Popen[Any], what: str, timeout: float = 15.0) -> None:
    def check() -> bool:
        assert proc.poll() is None, f"the poller exited with {proc.returncode} while waiting for {what}"
        return predicate()

    assert wait_until(check, timeout=timeout), f"timed out waiting for {what}"


def test_standalone_poller_streams_to_a_buffer_and_exits_0_on_sigterm(tmp_path: Path) -> None:
    db = str(tmp_path / "kv.db")
    stderr_path = tmp_path / "poller.stderr"
    store = SqliteSource(db)
    proc: subprocess.Popen[Any] | None = None
    report = None
    rb = ReplayBuffer(bind="tcp://127.0.0.1:0")
    try:
        assert rb.endpoint.startswith("tcp://127.0.0.1:") and not rb.endpoint.endswith(":0")
        store.kv_put("k1", "train", tag={"global_steps": 1, "status": "running"})
        store.kv_put("k1", "train", tag={"status": "success", "reward": 0.5})  # merged in the store
        store.kv_batch_put(["k2", "k3"], "train", tags=[{"global_steps": 1, "status": "running"}] * 2)

        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "poller", "run", "--source", SPEC, "--source-kwargs", json.dumps({"path": db}),
                 "--connect", rb.endpoint, "--poll-interval", "0.05"],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)

        expected: dict[str, dict[str, Any]] = {
            "k1": {"global_steps": 1, "status": "success", "reward": 0.5},
            "k2": {"global_steps": 1, "status": "running"},
            "k3": {"global_steps": 1, "status": "running"},
        }
        _wait_for(lambda: rb.snapshot("train") == expected, proc, "the initial rows")

        # Updates merge into the buffer's tags; a new partition appears.
        store.kv_put("k2", "train", tag={"status": "success"})
        store.kv_put("e1", "eval", tag={"global_steps": 1, "status": "success"})
        expected["k2"] = {"global_steps": 1, "status": "success"}
        _wait_for(lambda: rb.snapshot() == {"train": expected, "eval": {"e1": {"global_steps": 1,
                                                                               "status": "success"}}},
                  proc, "the update and the new partition")
        batch = rb.sample("train", batch_size=2, timeout=5)
        assert sorted(batch.keys) == ["k1", "k2"]

        # Cleared rows vanish from the buffer.
        store.kv_clear(["k1", "k3"], "train")
        store.kv_clear(["e1"], "eval")
        _wait_for(lambda: rb.snapshot() == {"train": {"k2": {"global_steps": 1, "status": "success"}}},
                  proc, "the cleared rows to vanish")

        stats = rb.stats()
        assert stats["protocol_errors"] == 0 and stats["source_errors"] == 0
        assert stats["messages"] >= 3 and stats["items_received"] >= 6
        assert stats["poller_pid"] is None  # a standalone poller is not the buffer's child

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        store.close()
        report = rb.close()
    assert report.stage == "no-poller"
    assert report.exitcode is None
    err_text = stderr_path.read_text(errors="replace")
    assert "Traceback" not in err_text, err_text


# -- the demo ----------------------------------------------------------------------------------------

def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> tuple[Any, str, str]:
    """Run ``argv`` from the checkout to its end (killed at ``timeout``): the process, its stdout and stderr."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    return proc, out, err


def test_demo_runs_and_shuts_down_gracefully(tmp_path: Path) -> None:
    # A private TMPDIR: the demo's store and ipc directory land there, where we
    # can check it removed them, and not next to other runs' /tmp/replay-* dirs.
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(private_tmp))
    proc, out, err = _run([sys.executable, "-m", "buffer.demo", "--seconds", "2"], timeout=60, env=env)
    assert proc.returncode == 0, f"stdout:\n{out}\nstderr:\n{err}"
    assert "shutdown: stage graceful" in out, out
    assert "poller exit code 0" in out and "drained True" in out, out
    assert "duplicates 0, lost 0, wrong tags 0" in out, out
    assert "result: OK" in out, out
    assert list(private_tmp.iterdir()) == []  # its store and ipc directory were removed


def test_bad_log_level_is_a_one_line_error(tmp_path: Path) -> None:
    proc, _, err = _run([sys.executable, "-m", "poller", "run", "--source", SPEC,
                         "--source-kwargs", json.dumps({"path": str(tmp_path / "kv.db")}),
                         "--connect", "tcp://127.0.0.1:1", "--log-level", "bogus"], timeout=20)
    assert proc.returncode == 2, err
    assert len(err.splitlines()) == 1 and "error" in err and "Traceback" not in err, err


# -- errors that speak --------------------------------------------------------------------------

def _run_cli(args: list[str], timeout: float = 60.0, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, **kwargs)


def test_a_source_failing_for_good_exits_3_with_the_reason_on_stderr(tmp_path: Path) -> None:
    rb = ReplayBuffer(bind="tcp://127.0.0.1:0")
    try:
        result = _run_cli([sys.executable, "-m", "poller", "run", "--source", SPEC,
                           "--source-kwargs", json.dumps({"path": str(tmp_path / "kv.db")}),
                           "--fault", "raise_:exc=ConnectionError,message=store unreachable",
                           "--connect", rb.endpoint, "--poll-interval", "0.01"])
    finally:
        rb.close()
    assert result.returncode == 3, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("python -m poller run: error: kv_list() of ")
    assert "failed 5 times in a row, last with ConnectionError: store unreachable" in lines[0]


def test_the_console_script_names_itself_in_errors() -> None:
    # What the `poller` console script runs, started as .../bin/poller.
    code = "import sys; sys.argv[0] = '/somewhere/bin/poller'; from poller.cli import main_entry; main_entry()"
    result = _run_cli([sys.executable, "-c", code, "run", "--connect", "tcp://127.0.0.1:1"])
    assert result.returncode == 2
    assert result.stderr == "poller run: error: --source is required (or --fault)\n"
    result = _run_cli([sys.executable, "-c", code, "run", "--source", SPEC, "--connect", "x", "--poll-interval", "0"])
    assert result.stderr == "poller run: error: --poll-interval must be a number of seconds > 0, got 0.0\n"
    result = _run_cli([sys.executable, "-c", code, "run"])
    assert result.stderr.startswith("poller run: error: ") and "python -m" not in result.stderr
    # Started as python -m poller, they say so.
    result = _run_cli([sys.executable, "-m", "poller", "run", "--connect", "tcp://127.0.0.1:1"])
    assert result.stderr == "python -m poller run: error: --source is required (or --fault)\n"


def test_ctrl_c_on_the_demo_says_interrupted_and_reports_nothing_lost(tmp_path: Path) -> None:
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(private_tmp), PYTHONUNBUFFERED="1")
    # Its own process group, as a terminal has: Ctrl-C reaches the demo, its writers and its poller.
    proc = subprocess.Popen([sys.executable, "-m", "buffer.demo", "--seconds", "60", "--keys-per-step", "256"],
                            cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout is not None
        seen = []
        for line in proc.stdout:  # bounded by the demo's progress lines (every 0.5 s) and pytest-timeout
            seen.append(line)
            if line.startswith("step"):
                break
        assert seen and seen[-1].startswith("step"), "".join(seen)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    out = "".join(seen) + out
    assert proc.returncode == 130, f"stdout:\n{out}\nstderr:\n{err}"
    assert "result: INTERRUPTED" in out, out
    assert "lost" not in out and "error:" not in out, out
    assert "not sampled (interrupted)" in out and "shutdown: stage graceful" in out, out
    assert "Traceback" not in err, err
    assert list(private_tmp.iterdir()) == []
