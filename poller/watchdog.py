"""A tiny process, forked from the poller, that ends an orphaned poller which cannot end itself.

The poller notices its trainer's death itself (EOF on the lifeline, a changed
parent pid), but only while its control loop runs: not while its source
factory builds (a store client connecting forever), while it is wedged, or
while it is stopped (SIGSTOP, a debugger). PR_SET_PDEATHSIG cannot help: it
fires when the *thread* that spawned the child ends, and a trainer may start a
buffer from any thread. So the poller forks this watchdog first thing::

    trainer ══lifeline══▶ poller ──exit pipe──▶ watchdog
                 ╚═══════════(watched for hang-up)═══╝

It only waits: for the poller to exit (EOF on the exit pipe: it exits too), or
for the trainer to go (hang-up on the lifeline, or a changed parent pid of the
poller); then it gives the poller a short grace, SIGKILLs it and removes the
directory the trainer would have removed. It never reads the lifeline, so it
takes no message meant for the poller.
"""

from __future__ import annotations

import os
import select
import signal

from poller.wire.procfs import parent_of, set_process_name

__all__ = ["start_watchdog"]

# A healthy orphan exits within a tick (0.2 s) of its parent: that and a margin, well under a second.
_GRACE_S = 0.4
WATCHDOG_PROCESS_NAME = "replay-watchdog"
_CHECK_S = 0.2


def start_watchdog(lifeline_fd: int, orphan_cleanup: str | None) -> None:
    """Fork the watchdog of this process. Call it before starting any thread."""
    poller_pid = os.getpid()
    trainer_pid = os.getppid()
    exit_r, exit_w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(exit_r)
        # Kept open, never written: the watchdog sees EOF when we are gone.
        _keep.append(exit_w)
        return
    try:
        set_process_name(WATCHDOG_PROCESS_NAME)  # its command line is the poller's (a fork): tell them apart
        _yield_to_everyone()
        _close_fds_except(lifeline_fd, exit_r)
        _watch(poller_pid, trainer_pid, lifeline_fd, exit_r, orphan_cleanup)
    finally:
        os._exit(0)


_keep: list[int] = []


def _yield_to_everyone() -> None:
    """Run only when no other task wants a core (SCHED_IDLE; else the lowest nice).

    It exits with its poller, while the poller's exit and the trainer's reaping
    are under way, and its exit (~1 ms freeing shared pages) took a core from
    them on a loaded 2-core machine. Ending an orphan takes microseconds.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass


def _close_fds_except(*keep: int) -> None:
    # Above all the sentinel pipe of multiprocessing: while we held it, the
    # trainer would not see the poller die.
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass


def _watch(poller_pid: int, trainer_pid: int, lifeline_fd: int, exit_r: int, cleanup: str | None) -> None:
    # Signals to the whole process group (Ctrl-C, `timeout`, `kill -TERM -PGID`) must not end
    # the watchdog before the poller: a poller ignoring SIGTERM then outlived them both.
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
