"""The buffer's private ipc directory: a fresh 0700 directory holding the default endpoint's socket.

Removed by the buffer's ``close()`` (or finalizer, or interpreter exit), by the poller or its watchdog
when the trainer died, else (a trainer killed without a poller) by the next buffer on this host, as
*stale*: its ``owner`` file's pid is gone or now belongs to a process started at another time. Only the
owner removes it (a forked child inherits the finalizer); a directory of another user, without a readable
owner file, or of another pid namespace (a container sharing ``/tmp``) is never touched.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import shutil
import stat
import tempfile

from poller.common.procfs import start_time, state

__all__ = ["PrivateIpcDir", "remove_stale"]

logger = logging.getLogger(__name__)

PREFIX = "replay-"
OWNER_FILE = "owner"
# Unix socket paths are limited to 107 bytes (sun_path); leave room.
_MAX_IPC_PATH = 100
_SOCKET_NAME = "stream"


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


class PrivateIpcDir:
    """A fresh 0700 directory for the buffer's ipc socket, its owner (pid, start time, pid namespace) recorded."""

    def __init__(self) -> None:
        path = tempfile.mkdtemp(prefix=PREFIX)
        if len(path) + len(_SOCKET_NAME) + 1 > _MAX_IPC_PATH:
            os.rmdir(path)  # TMPDIR is too deep for a socket path
            path = tempfile.mkdtemp(prefix=PREFIX, dir="/tmp")
        try:
            fd = os.open(os.path.join(path, OWNER_FILE), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "start": start_time(os.getpid()), "pidns": _pid_namespace()}, f)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        self.path = path
        self.owner_pid = os.getpid()
        self._removed = False

    @property
    def endpoint(self) -> str:
        return f"ipc://{self.path}/{_SOCKET_NAME}"

    def remove(self) -> None:
        """Remove the directory, in its owner process only (not in a forked child); idempotent."""
        if os.getpid() == self.owner_pid and not self._removed:
            shutil.rmtree(self.path, ignore_errors=True)
            self._removed = True


def _owner_gone(record: object) -> bool:
    """True only when the recorded owner process surely no longer runs."""
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return False
    if record.get("pidns") != _pid_namespace():
        return False  # another namespace's pid: cannot tell
    pid = record["pid"]
    if pid == os.getpid():
        return False
    started = start_time(pid)
    if started is None or state(pid) == "Z":
        return True
    return record.get("start") is not None and started != record["start"]


def remove_stale() -> None:
    """Remove this user's ipc directories whose owner process is gone (in the temporary directory and
    ``/tmp``, used when that is too deep for a socket path). Never raises."""
    for place in {tempfile.gettempdir(), "/tmp"}:
        for path in glob.glob(os.path.join(glob.escape(place), PREFIX + "*")):
            try:
                info = os.lstat(path)
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                    continue  # a symlink or a file, or another user's
                with open(os.path.join(path, OWNER_FILE)) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                continue  # not ours, not a buffer's, or still being made
            if _owner_gone(record):
                shutil.rmtree(path, ignore_errors=True)
                logger.info("removed the stale ipc directory %s of process %s, which is gone", path,
                            record.get("pid"))
