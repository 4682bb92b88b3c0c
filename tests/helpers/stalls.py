"""Sources that stall on a script, importable by spec from a spawned poller."""

from __future__ import annotations

from typing import Any

from poller.sources.contract import SourceStall


class ScriptedStalls:
    """Each kv_list() follows ``script``: ``S`` raises SourceStall, ``L`` lists.

    Past the end of the script it keeps listing.
    """

    def __init__(self, script: str) -> None:
        self._script = list(script)

    def kv_list(self) -> Any:
        step = self._script.pop(0) if self._script else "L"
        if step == "S":
            raise SourceStall("the scripted store did not answer in time")
        return {"train": {"k": {"status": "success"}}}


class TimedStalls:
    """A store that stops answering for a while: each kv_list() follows ``script``.

    ``L`` answers at once, ``S`` gives up after ``seconds`` with
    :class:`~poller.sources.contract.SourceStall` (as the TransferQueue source does at
    its ``call_timeout``); past the end of the script every call answers.
    Each call appends ``"<time.monotonic()> <step>"`` to ``log`` as it begins
    (CLOCK_MONOTONIC: the test process reads the same clock). An answer holds
    one key, ``"k"``, whose ``answers`` tag counts the answers so far.
    """

    def __init__(self, log: str, script: str, seconds: float) -> None:
        self._log = log
        self._script = list(script)
        self._seconds = seconds
        self._answers = 0

    def kv_list(self) -> Any:
        import time

        step = self._script.pop(0) if self._script else "L"
        with open(self._log, "a") as f:
            f.write(f"{time.monotonic()!r} {step}\n")
        if step == "S":
            time.sleep(self._seconds)
            raise SourceStall(f"no answer within {self._seconds:g}s")
        self._answers += 1
        return {"train": {"k": {"status": "success", "answers": self._answers}}}


def call_starts(log: str) -> list[tuple[float, str]]:
    """The calls a :class:`TimedStalls` logged: (monotonic start, ``"L"`` or ``"S"``)."""
    with open(log) as f:
        lines = f.read().split("\n")[:-1]  # a line still being written is left out
    return [(float(when), step) for when, step in (line.split() for line in lines)]
