"""Sources that stall on a script, importable by spec from a spawned poller."""

from __future__ import annotations

from typing import Any

from poller.sources import SourceStall


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


class StallsWhileFlagged:
    """The SQLite store at ``path`` behind a client with a deadline: while ``flag`` exists its server hangs.

    Each call made while the file ``flag`` exists waits ``seconds`` and raises
    :class:`SourceStall`, as the TransferQueue client does at its
    ``call_timeout`` when its controller stopped answering; otherwise it lists
    the store.
    """

    def __init__(self, path: str, flag: str, seconds: float = 0.3) -> None:
        from poller.sources.sqlite import SqliteSource

        self._store = SqliteSource(path)
        self._flag = flag
        self._seconds = seconds

    def kv_list(self) -> Any:
        import os
        import time

        if os.path.exists(self._flag):
            time.sleep(self._seconds)
            raise SourceStall(f"no answer within {self._seconds}s")
        return self._store.kv_list()

    def close(self) -> None:
        self._store.close()
