"""How a poller launched by :mod:`buffer.process` begins, and the watchdog that ends it as an orphan.

``python -m poller.child FD NAME``: the lifeline's fd, and the stream's name (for ``ps`` only).
The parent's modules, its ``__main__`` and ``multiprocessing`` stay out of the child.

The poller notices its trainer's death only while its control loop runs (not while its factory builds, or wedged,
or stopped), and PR_SET_PDEATHSIG fires when the *thread* that spawned the child ends. So it first forks a watchdog::

    trainer ══lifeline══▶ poller ──exit pipe──▶ watchdog
                 ╚═══════════(watched for hang-up)═══╝

When the trainer goes (hang-up on the lifeline, or a changed parent pid of the poller) it gives the poller a short
grace, SIGKILLs it and removes the trainer's ipc directory. It is forked before anything heavy is imported: copying a
~20 MB poller's page tables was most of its idle kernel time.

A poller that exits by itself (a close, a crash, its trainer gone) ends its watchdog last, SIGKILL then waitpid, so it
leaves no process behind: an orphaned watchdog was adopted by the nearest subreaper, and a trainer that never reaps
(PID 1 in a container) collected one zombie per poller (issue 38). One killed from outside leaves its watchdog to see
EOF on the exit pipe and exit too, orphaned.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

from poller.common.lifeline import CLEANUP_VARIABLE, PATH_VARIABLE
from poller.common.procfs import parent_of, set_process_name

__all__ = ["main"]

#: The process names (``/proc/PID/comm``) of the poller and of its watchdog, a fork with the same command line.
POLLER_PROCESS_NAME = "replay-poller"
WATCHDOG_PROCESS_NAME = "replay-watchdog"

# A pickled WorkerConfig is a few hundred bytes; a callable source can be larger.
_MAX_CONFIG_BYTES = 64 * 1024 * 1024
# How often the watchdog checks the poller's parent; its grace for a healthy orphan (one tick and a margin).
_CHECK_S = 0.2
_GRACE_S = 0.4
# The most a poller waits to reap the watchdog it killed (~1 ms; a machine stalled for longer leaves it orphaned).
_REAP_S = 1.0


def main(lifeline_fd: int) -> None:
    """Fork the watchdog, read the configuration from the lifeline, then run; never returns."""
    set_process_name(POLLER_PROCESS_NAME)  # for ps -e, top, pgrep: not "python3.11"
    watchdog = _start_watchdog(lifeline_fd, os.environ.pop(CLEANUP_VARIABLE, None) or None)
    _take_parent_path()

    import pickle

    from poller.common import lifeline
    from poller.common.config import ExitCode
    from poller.worker import run_embedded

    channel = lifeline.Channel(lifeline_fd)
    try:
        config = pickle.loads(channel.recv_bytes(_MAX_CONFIG_BYTES))
    except BaseException as exc:
        # e.g. a callable source whose module this interpreter cannot import
        lifeline.send(channel, lifeline.failure(exc, lifeline.StartFailed))
        _end_watchdog(watchdog)
        os._exit(ExitCode.STARTUP_FAILED)
    run_embedded(config, channel, before_exit=lambda: _end_watchdog(watchdog))


def _take_parent_path() -> None:
    """The parent's exact sys.path; the environment as the parent had it, for the source's own children."""
    path = os.environ.pop(PATH_VARIABLE, None)
    if path is not None:
        sys.path[:] = path.split(os.pathsep)
        os.environ.pop("PYTHONPATH", None)
    previous = os.environ.pop(PATH_VARIABLE + "_PYTHONPATH", None)
    if previous is not None:
        os.environ["PYTHONPATH"] = previous


def _start_watchdog(lifeline_fd: int, orphan_cleanup: str | None) -> int:
    """Fork the watchdog of this process and return its pid. Call it before starting any thread."""
    poller_pid = os.getpid()
    trainer_pid = os.getppid()
    exit_r, exit_w = os.pipe()  # exit_w stays open, never written: the watchdog sees EOF when we are gone
    pid = os.fork()
    if pid:
        os.close(exit_r)
        return pid
    try:
        set_process_name(WATCHDOG_PROCESS_NAME)
        # At the poller's own priority: its exit (~1 ms) comes first now and the poller waits for it (_end_watchdog).
        # At SCHED_IDLE, with both cores busy, that wait made a graceful close take ~40-370 ms instead of ~10.
        # Above all the launcher's sentinel pipe: while we held it, the trainer would not see the poller die.
        for fd in map(int, os.listdir("/proc/self/fd")):
            if fd > 2 and fd not in (lifeline_fd, exit_r):
                try:
                    os.close(fd)
                except OSError:
                    pass
        _watch(poller_pid, trainer_pid, lifeline_fd, exit_r, orphan_cleanup)
    finally:
        os._exit(0)


def _end_watchdog(pid: int) -> None:
    """SIGKILL the watchdog and reap it, waiting at most ``_REAP_S``: this poller is about to exit by itself.

    Called last, right before ``os._exit``: until then the watchdog still guards a poller that wedges on its way out.
    """
    try:
        os.kill(pid, signal.SIGKILL)  # not the exit pipe: a child the source forked may hold its write end too
    except ProcessLookupError:
        return
    deadline = time.monotonic() + _REAP_S
    delay = 0.0002
    while True:
        try:
            reaped, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # reaped already
            return
        if reaped or time.monotonic() >= deadline:
            return  # not reaped in time: the old way, adopted by whoever reaps orphans
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


def _watch(poller_pid: int, trainer_pid: int, lifeline_fd: int, exit_r: int, cleanup: str | None) -> None:
    # Signals to the process group (Ctrl-C, `timeout`) must not end the watchdog before the poller.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    poll = select.poll()
    poll.register(exit_r, select.POLLIN)
    # RDHUP without IN: told when the trainer's end closes, never about data.
    poll.register(lifeline_fd, select.POLLRDHUP)
    while True:
        events = dict(poll.poll(int(_CHECK_S * 1000)))
        if exit_r in events:
            return  # the poller exited
        if lifeline_fd in events or parent_of(poller_pid) != trainer_pid:
            break
    poll.unregister(lifeline_fd)
    if poll.poll(int(_GRACE_S * 1000)):
        return  # it noticed by itself and left
    try:
        os.kill(poller_pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if cleanup:
        import shutil  # here: shutil loads zlib, bz2 and lzma, which the poller would carry from the fork

        shutil.rmtree(cleanup, ignore_errors=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
