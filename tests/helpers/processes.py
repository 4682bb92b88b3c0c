"""Process facts from Linux's /proc that tests and benches need: is a pid running, and its children."""

from __future__ import annotations

import os

from poller.wire.procfs import state

__all__ = ["children_of", "is_running"]


def is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    return state(pid) not in (None, "Z")


def children_of(pid: int) -> set[int]:
    """Live (non-zombie) children of ``pid``."""
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                # After the command name, which may hold spaces and parentheses: state, parent pid.
                status, parent = f.read().rsplit(")", 1)[1].split()[:2]
        except (OSError, IndexError, ValueError):
            continue  # not a process, or gone
        if status != "Z" and int(parent) == pid:
            found.add(int(entry))
    return found
