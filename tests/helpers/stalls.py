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
