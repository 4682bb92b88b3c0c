"""Reading what a child process prints, with a deadline."""

from __future__ import annotations

import select
import subprocess


def first_line(proc: subprocess.Popen[str], timeout: float = 60.0) -> str:
    """The next line ``proc`` prints on its stdout pipe; fails the test past ``timeout`` or at EOF."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"the child printed nothing within {timeout}s"
    line = proc.stdout.readline()
    assert line, f"the child exited (code {proc.poll()}) before printing a line"
    return line
