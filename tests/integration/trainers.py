"""Trainer processes the integration tests start and kill."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.helpers.lines import first_line

REPO = Path(__file__).resolve().parents[2]


def sigkill_after_start(script: str, argument: Any, timeout: float = 120.0) -> dict[str, Any]:
    """Run ``python -c script json(argument)``, read the JSON line it prints once started, SIGKILL it.

    Returns that line. The process is reaped on every path, and the wait for
    its line has a deadline (a trainer stuck before printing fails the test).
    """
    trainer = subprocess.Popen([sys.executable, "-c", script, json.dumps(argument)], cwd=REPO,
                               stdout=subprocess.PIPE, text=True)
    assert trainer.stdout is not None
    try:
        line = first_line(trainer, timeout)
        trainer.send_signal(signal.SIGKILL)
        assert trainer.wait(30) == -signal.SIGKILL
        started: dict[str, Any] = json.loads(line)
        return started
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait(30)
        trainer.stdout.close()
