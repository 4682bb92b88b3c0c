"""``python tests/helpers/traced_poller.py TRACE_FILE ARGS...``: ``python -m poller ARGS...`` with a record of
which product modules each thread calls into while the file ``TRACE_FILE + ".on"`` exists, written as JSON to
``TRACE_FILE`` when the process exits."""

from __future__ import annotations

import atexit
import json
import os
import runpy
import sys
import threading
import time
from types import FrameType
from typing import Any

_modules: dict[str, set[str]] = {}
_recording = [False]


def _watch(flag: str) -> None:
    while True:
        _recording[0] = os.path.exists(flag)
        time.sleep(0.002)


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call" and _recording[0]:
        module = frame.f_globals.get("__name__") or ""
        if module.startswith(("poller", "buffer")):
            _modules.setdefault(threading.current_thread().name, set()).add(module)


def main() -> None:
    trace_file = sys.argv[1]

    @atexit.register
    def _write() -> None:
        sys.setprofile(None)
        with open(trace_file, "w") as out:
            json.dump({thread: sorted(modules) for thread, modules in _modules.items()}, out)

    threading.Thread(target=_watch, args=(trace_file + ".on",), daemon=True).start()
    threading.setprofile(_profile)
    sys.setprofile(_profile)
    sys.argv = ["poller", *sys.argv[2:]]
    runpy.run_module("poller", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
