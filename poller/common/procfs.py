"""Process facts read from Linux's /proc, and a process's own name."""

from __future__ import annotations

import os

__all__ = ["state", "parent_of", "set_process_name", "start_time", "own_rss_bytes"]

_COMM_LENGTH = 15  # the kernel keeps 16 bytes with the terminating NUL


def set_process_name(name: str) -> bool:
    """Set this process's name as ``ps -e``, ``top`` and ``pgrep`` show it; False where it failed.

    Call it from the main thread: ``/proc/thread-self/comm`` is ``prctl(PR_SET_NAME)`` for the
    calling thread, written here because importing ctypes costs the poller ~2 ms.
    """
    try:
        with open("/proc/thread-self/comm", "wb") as f:
            f.write(name.encode()[:_COMM_LENGTH])
        return True
    except OSError:
        return False


def _fields(pid: int) -> list[str] | None:
    """The fields after the command name (state first), or None once ``pid`` is gone.

    The name is in parentheses and may itself hold spaces and parentheses: counted from the last ``)``.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def state(pid: int) -> str | None:
    """One letter (``R``, ``S``, ``T`` stopped, ``Z`` zombie, ...), or None once ``pid`` is gone."""
    fields = _fields(pid)
    return fields[0] if fields else None


def parent_of(pid: int) -> int | None:
    fields = _fields(pid)
    return int(fields[1]) if fields else None


def start_time(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot; with the pid, it names one process for good), or None."""
    fields = _fields(pid)
    return int(fields[19]) if fields and len(fields) > 19 else None


def own_rss_bytes() -> int:
    """This process's resident memory in bytes (0 if /proc cannot tell)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
