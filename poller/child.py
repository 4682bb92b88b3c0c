"""How a poller launched by :mod:`buffer.process` begins, and the watchdog that ends it as an orphan.

``python -m poller.child FD NAME``: the lifeline's fd, and the stream's name (for ``ps`` only).
The parent's modules, its ``__main__`` and ``multiprocessing`` stay out of the child.

The poller notices its trainer's death only while its control loop runs (not while its factory builds, or wedged,
or stopped), and PR_SET_PDEATHSIG fires when the *thread* that spawned the child ends. So it first forks a watchdog::

    trainer ══lifeline══▶ poller ──exit pipe──▶ watchdog
                 ╚═══════════(watched for hang-up)═══╝

It exits with the poller (EOF on the exit pipe); when the trainer goes (hang-up on the lifeline, or a changed parent
pid of the poller) it gives the poller a short grace, SIGKILLs it and removes the trainer's ipc directory. It is
forked before anything heavy is imported: copying a ~20 MB poller's page tables was most of its idle kernel time.
"""

from __future__ import annotations

import os
import select
import signal
import sys

from poller.wire.lifeline import CLEANUP_VARIABLE, PATH_VARIABLE
from poller.wire.procfs import parent_of, set_process_name

__all__ = ["main"]

#: The process names (``/proc/PID/comm``) of the poller and of its watchdog, a fork with the same command line.
POLLER_PROCESS_NAME = "replay-poller"
WATCHDOG_PROCESS_NAME = "replay-watchdog"

# A pickled WorkerConfig is a few hundred bytes; a callable source can be larger.
_MAX_CONFIG_BYTES = 64 * 1024 * 1024
# How often the watchdog checks the poller's parent; its grace for a healthy orphan (one tick and a margin).
_CHECK_S = 0.2
_GRACE_S = 0.4


def main(lifeline_fd: int) -> None:
    """Fork the watchdog, read the configuration from the lifeline, then run; never returns."""
    set_process_name(POLLER_PROCESS_NAME)  # for ps -e, top, pgrep: not "python3.11"
    _start_watchdog(lifeline_fd, os.environ.pop(CLEANUP_VARIABLE, None) or None)
    _take_parent_path()

    import pickle

    from poller.wire import lifeline
    from poller.wire.config import ExitCode
    from poller.worker import run_embedded

    channel = lifeline.Channel(lifeline_fd)
    try:
        config = pickle.loads(channel.recv_bytes(_MAX_CONFIG_BYTES))
    except BaseException as exc:
        # e.g. a callable source whose module this interpreter cannot import
        lifeline.send(channel, lifeline.failure(exc, lifeline.StartFailed))
        os._exit(ExitCode.STARTUP_FAILED)
    run_embedded(config, channel)


def _take_parent_path() -> None:
    """The parent's exact sys.path; the environment as the parent had it, for the source's own children."""
    path = os.environ.pop(PATH_VARIABLE, None)
    if path is not None:
        sys.path[:] = path.split(os.pathsep)
        os.environ.pop("PYTHONPATH", None)
    previous = os.environ.pop(PATH_VARIABLE + "_PYTHONPATH", None)
    if previous is not None:
        os.environ["PYTHONPATH"] = previous


def _start_watchdog(lifeline_fd: int, orphan_cleanup: str | None) -> None:
    """Fork the watchdog of this process. Call it before starting any thread."""
    poller_pid = os.getpid()
    trainer_pid = os.getppid()
    exit_r, exit_w = os.pipe()  # exit_w stays open, never written: the watchdog sees EOF when we are gone
    if os.fork():
        os.close(exit_r)
        return
    try:
        set_process_name(WATCHDOG_PROCESS_NAME)
        # Run only when no other task wants a core: its exit (~1 ms) would take one from its poller's.
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (AttributeError, OSError):
            try:
                os.nice(19)
            except OSError:
                pass
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
