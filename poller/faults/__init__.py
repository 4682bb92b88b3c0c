"""Fault-injecting sources: prove that a trainer survives whatever its poller does.

Each fault is a factory named by spec, so a spawned poller can build it::

    ReplayBuffer(source="poller.faults:hang",
                 source_kwargs={"inner": "poller.sources.sqlite:SqliteSource",
                                "inner_kwargs": {"path": "kv.db"}, "after": 3})

    python -m poller run --source poller.sources.sqlite:SqliteSource \\
        --source-kwargs '{"path": "kv.db"}' --fault hang:after=3 --connect ...

A fault wraps an optional *inner* source (``inner`` spec plus
``inner_kwargs``; without one it lists nothing) and behaves like it until it
*fires*: after ``after`` successful calls and ``after_s`` seconds since it was
built, and (when ``when_exists`` names a file) once that file exists, so a
test can pull the trigger at the moment it chooses. ``marker`` names a file written (with the pid) when it fires; with
``once=True`` the fault fires in the first process that creates the marker
only, so a restarted poller runs clean. Faults that take the whole process
down (``crash``, ``freeze``) or wedge its control loop (``ignore_stop``,
``ignore_sigterm``) act on the process that calls ``kv_list()``.

The wire-level counterpart is :class:`poller.faults.peer.RoguePeer`; store
faults on the SQLite file are in :mod:`poller.faults.store`.
"""

from __future__ import annotations

import builtins
import ctypes
import json
import os
import random
import signal
import threading
import time
from typing import Any, Mapping

from poller.faults.shapes import GARBAGE
from poller.sources.contract import SourceSpec, SourceStall, load_source

__all__ = [
    "FAULTS",
    "GARBAGE",
    "Fault",
    "parse_fault",
    "raise_",
    "flaky",
    "slow",
    "hang",
    "freeze",
    "ignore_stop",
    "ignore_sigterm",
    "crash",
    "garbage",
    "huge",
    "leak",
    "down",
    "stall",
]


class Fault:
    """A source that lists ``inner`` until it fires, then calls :meth:`misbehave`."""

    def __init__(self, *, inner: SourceSpec | None = None, inner_kwargs: Mapping[str, Any] | None = None,
                 after: int = 0, after_s: float = 0.0, when_exists: str | None = None, marker: str | None = None,
                 once: bool = False) -> None:
        if not isinstance(after, int) or after < 0:
            raise ValueError(f"after must be a non-negative int, got {after!r}")
        if not after_s >= 0:
            raise ValueError(f"after_s must be >= 0, got {after_s!r}")
        if once and not marker:
            raise ValueError("once=True needs a marker file")
        self.inner = load_source(inner, inner_kwargs) if inner is not None else None
        self.after = after
        self.after_s = float(after_s)
        self.when_exists = when_exists
        self.marker = marker
        self.once = once
        self.calls = 0
        self.fired = 0
        self._born = time.monotonic()
        self._disarmed = False

    def listing(self) -> Any:
        """What the inner source lists (``{}`` without one)."""
        return self.inner.kv_list() if self.inner is not None else {}

    def kv_list(self) -> Any:
        self.calls += 1
        if self._armed():
            self.fired += 1
            return self.misbehave()
        return self.listing()

    def misbehave(self) -> Any:
        raise NotImplementedError

    # What a trainer-side client does besides listing goes to the inner store
    # untouched (the verl sampler clears keys and reads fields through it).
    # Never kv_snapshot / kv_changes: the poller must see this wrapper's kv_list().

    def kv_clear(self, keys: list[str], partition_id: str) -> Any:
        return self._inner("kv_clear")(keys, partition_id)

    def kv_batch_get(self, keys: list[str], partition_id: str, select_fields: list[str] | None = None) -> Any:
        return self._inner("kv_batch_get")(keys, partition_id, select_fields=select_fields)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if callable(close):
            close()

    def _inner(self, name: str) -> Any:
        method = getattr(self.inner, name, None)
        if not callable(method):
            raise AttributeError(f"the inner source {self.inner!r} has no {name}()")
        return method

    def _armed(self) -> bool:
        if self._disarmed or self.calls <= self.after or time.monotonic() - self._born < self.after_s:
            return False
        if self.when_exists is not None and not os.path.exists(self.when_exists):
            return False
        if self.fired == 0 and self.marker:
            if self.once:
                try:  # O_EXCL: of all the processes that try, one fires
                    fd = os.open(self.marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                except FileExistsError:
                    self._disarmed = True
                    return False
            else:
                fd = os.open(self.marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(str(os.getpid()))
        return True


class _Raise(Fault):
    def __init__(self, *, exc: str = "RuntimeError", message: str = "injected fault", times: int | None = None,
                 **trigger: Any) -> None:
        error = getattr(builtins, exc, None)
        # BaseException too: a store client that calls sys.exit() raises SystemExit in the poller.
        if not (isinstance(error, type) and issubclass(error, BaseException)):
            raise ValueError(f"exc must name a builtin exception class, got {exc!r}")
        super().__init__(**trigger)
        self.error: type[BaseException] = error
        self.message = message
        self.times = times

    def misbehave(self) -> Any:
        if self.times is not None and self.fired > self.times:
            return self.listing()  # recovered
        raise self.error(f"{self.message} (call {self.calls})")


def raise_(*, exc: str = "RuntimeError", message: str = "injected fault", times: int | None = None,
           **trigger: Any) -> Fault:
    """``kv_list()`` raises ``exc(message)`` once fired; ``times`` calls, then recovers (None: forever)."""
    return _Raise(exc=exc, message=message, times=times, **trigger)


class _Flaky(Fault):
    def __init__(self, *, p: float = 0.5, seed: int = 0, **trigger: Any) -> None:
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"p must be a probability, got {p!r}")
        super().__init__(**trigger)
        self.p = p
        self.random = random.Random(seed)

    def misbehave(self) -> Any:
        if self.random.random() < self.p:
            raise ConnectionError(f"flaky store (call {self.calls})")
        return self.listing()


def flaky(*, p: float = 0.5, seed: int = 0, **trigger: Any) -> Fault:
    """Each call fails with probability ``p`` (``ConnectionError``), from a seeded generator."""
    return _Flaky(p=p, seed=seed, **trigger)


class _Slow(Fault):
    def __init__(self, *, seconds: float = 1.0, start_s: float = 0.0, **trigger: Any) -> None:
        time.sleep(start_s)
        super().__init__(**trigger)
        self.seconds = seconds

    def misbehave(self) -> Any:
        time.sleep(self.seconds)
        return self.listing()


def slow(*, seconds: float = 1.0, start_s: float = 0.0, **trigger: Any) -> Fault:
    """Each call takes ``seconds`` longer; building the source takes ``start_s``."""
    return _Slow(seconds=seconds, start_s=start_s, **trigger)


class _Hang(Fault):
    def misbehave(self) -> Any:
        threading.Event().wait()  # a store client with no timeout, its server gone


def hang(**trigger: Any) -> Fault:
    """``kv_list()`` never returns."""
    return _Hang(**trigger)


class _Freeze(Fault):
    def misbehave(self) -> Any:
        # The whole process stops; STOP, SIGTERM and parent death go unseen
        # and only SIGKILL ends it. Something else may send SIGCONT (job
        # control, a debugger detaching): the process then stops again at once,
        # so a frozen poller stays frozen.
        while True:
            os.kill(os.getpid(), signal.SIGSTOP)


def freeze(**trigger: Any) -> Fault:
    """The poller process stops itself with SIGSTOP: only SIGKILL ends it."""
    return _Freeze(**trigger)


# The signal that wedges the main thread; rarely used by applications.
_WEDGE_SIGNAL = signal.SIGUSR2


class _Wedge(Fault):
    """Wedges the main thread (the poller's control loop) in a signal handler."""

    def __init__(self, *, sigterm: Any, **trigger: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("this fault must be built in the main thread (it installs a signal handler)")
        super().__init__(**trigger)
        self._sigterm = sigterm
        # The marker says the control loop is wedged, so it is written by the
        # wedge itself: written when the source fired, it let a test's close()
        # send STOP before the signal arrived, and the poller said BYE (a
        # drained close that the test took for a wedged one).
        self._wedged_marker: str | None = None
        if not self.once:  # a once-only fault keeps the marker that picks the one process
            self._wedged_marker, self.marker = self.marker, None
        signal.signal(_WEDGE_SIGNAL, self._stuck)

    def _stuck(self, signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, self._sigterm)
        if self._wedged_marker:
            with open(self._wedged_marker, "w") as f:
                f.write(str(os.getpid()))
        while True:
            time.sleep(3600)

    def misbehave(self) -> Any:
        # Called in the source thread; the handler runs in the main thread.
        os.kill(os.getpid(), _WEDGE_SIGNAL)
        return self.listing()


def ignore_stop(**trigger: Any) -> Fault:
    """The control loop stops answering (STOP goes unread); SIGTERM still ends the process."""
    return _Wedge(sigterm=signal.SIG_DFL, **trigger)


def ignore_sigterm(**trigger: Any) -> Fault:
    """The control loop stops answering and SIGTERM is ignored: only SIGKILL ends the process."""
    return _Wedge(sigterm=signal.SIG_IGN, **trigger)


_CRASHES = ("exit", "segfault", "abort", "sigkill")


class _Crash(Fault):
    def __init__(self, *, how: str = "exit", code: int = 1, **trigger: Any) -> None:
        if how not in _CRASHES:
            raise ValueError(f"how must be one of {', '.join(_CRASHES)}; got {how!r}")
        super().__init__(**trigger)
        self.how = how
        self.code = code

    def misbehave(self) -> Any:
        if self.how == "exit":
            os._exit(self.code)
        if self.how == "segfault":
            ctypes.string_at(0)  # a real SIGSEGV, as from a broken C extension
        if self.how == "abort":
            os.abort()
        os.kill(os.getpid(), signal.SIGKILL)


def crash(*, how: str = "exit", code: int = 1, **trigger: Any) -> Fault:
    """The poller process dies: ``os._exit(code)``, a segfault, ``abort()`` or SIGKILL."""
    return _Crash(how=how, code=code, **trigger)


class _Garbage(Fault):
    def __init__(self, *, kind: str = "not-a-mapping", **trigger: Any) -> None:
        if kind not in GARBAGE:
            raise ValueError(f"kind must be one of {', '.join(GARBAGE)}; got {kind!r}")
        super().__init__(**trigger)
        self.kind = kind

    def misbehave(self) -> Any:
        bad = GARBAGE[self.kind]()
        listing = self.listing() or {}
        if isinstance(bad, dict) and isinstance(listing, dict):
            return {**listing, **bad}  # good partitions next to the bad one
        return bad


def garbage(*, kind: str = "not-a-mapping", **trigger: Any) -> Fault:
    """``kv_list()`` returns something that is not ``{str: {str: dict}}`` or cannot go on the wire."""
    return _Garbage(kind=kind, **trigger)


class _Huge(Fault):
    def __init__(self, *, megabytes: float = 16.0, value_bytes: int = 1024, partition: str = "huge",
                 **trigger: Any) -> None:
        super().__init__(**trigger)
        count = max(1, int(megabytes * 1024 * 1024) // max(1, value_bytes))
        blob = "x" * value_bytes  # one string shared by every key: the listing's size, not ours
        self.partition = partition
        self.items = {f"h{i:08d}": {"status": "finished", "blob": blob} for i in range(count)}

    def misbehave(self) -> Any:
        listing = dict(self.listing() or {})
        listing[self.partition] = self.items
        return listing


def huge(*, megabytes: float = 16.0, value_bytes: int = 1024, partition: str = "huge", **trigger: Any) -> Fault:
    """Adds a partition of about ``megabytes`` MiB: keys with ``value_bytes``-long tags."""
    return _Huge(megabytes=megabytes, value_bytes=value_bytes, partition=partition, **trigger)


class _Leak(Fault):
    def __init__(self, *, megabytes: float = 1.0, **trigger: Any) -> None:
        super().__init__(**trigger)
        self.size = int(megabytes * 1024 * 1024)
        self.hoard: list[bytes] = []

    def misbehave(self) -> Any:
        self.hoard.append(b"\x01" * self.size)  # written, so it is resident
        return self.listing()


def leak(*, megabytes: float = 1.0, **trigger: Any) -> Fault:
    """Every call keeps ``megabytes`` MiB more; watch ``stats()["poller_rss"]``."""
    return _Leak(megabytes=megabytes, **trigger)


class _Down(Fault):
    def __init__(self, **trigger: Any) -> None:
        super().__init__(**trigger)
        if self.when_exists is not None and os.path.exists(self.when_exists):
            raise ConnectionRefusedError(f"store down ({self.when_exists} exists): cannot connect")

    def misbehave(self) -> Any:
        raise ConnectionRefusedError(f"store down (call {self.calls})")


def down(**trigger: Any) -> Fault:
    """The store is unreachable: ``kv_list()`` raises ``ConnectionRefusedError``, and so does
    building the source while ``when_exists`` exists (a restarted poller cannot connect)."""
    return _Down(**trigger)


class _Stall(Fault):
    def __init__(self, *, seconds: float = 1.0, **trigger: Any) -> None:
        if not seconds >= 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}")
        super().__init__(**trigger)
        self.seconds = float(seconds)

    def misbehave(self) -> Any:
        time.sleep(self.seconds)
        raise SourceStall(f"no answer within {self.seconds:g}s (call {self.calls})")


def stall(*, seconds: float = 1.0, **trigger: Any) -> Fault:
    """The store stops answering a client with a deadline: each call gives up after ``seconds`` with
    :class:`~poller.sources.contract.SourceStall`, as the TransferQueue source does at its ``call_timeout``."""
    return _Stall(seconds=seconds, **trigger)


FAULTS = ("raise_", "flaky", "slow", "hang", "freeze", "ignore_stop", "ignore_sigterm", "crash", "garbage",
          "huge", "leak", "down", "stall")


def parse_fault(text: str, inner: SourceSpec | None = None,
                inner_kwargs: Mapping[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """Turn ``"NAME[:key=value,...]"`` into a source spec and its kwargs.

    Values are read as JSON where they parse (``3``, ``0.5``, ``true``,
    ``"x"``) and as plain strings otherwise. ``inner`` and ``inner_kwargs``
    become the wrapped source.

    Raises:
        ValueError: an unknown fault name or a malformed ``key=value``.
    """
    name, _, rest = text.partition(":")
    name = name.strip()
    if name == "raise":
        name = "raise_"
    if name not in FAULTS:
        raise ValueError(f"unknown fault {name!r}; one of {', '.join(FAULTS)}")
    kwargs: dict[str, Any] = {}
    for pair in filter(None, (p.strip() for p in rest.split(","))):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"fault option {pair!r} is not key=value")
        try:
            kwargs[key.strip()] = json.loads(value)
        except ValueError:
            kwargs[key.strip()] = value
    if inner is not None:
        kwargs["inner"] = inner
        kwargs["inner_kwargs"] = dict(inner_kwargs or {})
    return f"{__name__}:{name}", kwargs
