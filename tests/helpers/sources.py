"""Test-only sources, importable by spec from a spawned poller.

Each is a module-level factory so ``spawn`` can rebuild it in the child.
Faults of ``kv_list()`` itself live in :mod:`poller.faults`.
"""

from __future__ import annotations

import os
from typing import Any


def failing_factory(**kwargs: Any) -> Any:
    raise ValueError(f"cannot connect to store with {kwargs}")


class Chatty:
    """Logs a warning (or ``level``) on every kv_list(): it must reach the trainer's logging."""

    def __init__(self, level: str = "WARNING") -> None:
        self.level = level

    def kv_list(self) -> Any:
        import logging

        logging.getLogger("poller.tests.chatty").log(logging.getLevelName(self.level),
                                                     "chatty source says hello from pid %d", os.getpid())
        return {}


def crash_then_hang_on_restart(marker: str) -> Any:
    """First build: a source whose process SIGKILLs itself on its second call.

    Every later build (the buffer's restart) writes its pid to ``marker`` and
    then never returns from the factory: a poller caught mid-restart.
    """
    import threading

    from poller.faults import crash

    first = marker + ".first"
    if os.path.exists(first):
        with open(marker, "w") as f:
            f.write(str(os.getpid()))
        threading.Event().wait()
    open(first, "w").close()
    return crash(how="sigkill", after=1)


class ReportsEnvironment:
    """Lists, as tags, the launcher's variables in the poller's environment (none may be left)."""

    def kv_list(self) -> Any:
        names = ("PYTHONPATH", "REPLAY_POLLER_SYS_PATH", "REPLAY_POLLER_SYS_PATH_PYTHONPATH")
        return {"environment": {name: {"value": os.environ.get(name, "")} for name in names}}


class ReportsModules:
    """Lists, as tags, which heavyweight modules the poller process imported."""

    def kv_list(self) -> Any:
        import sys

        watched = ("multiprocessing", "__mp_main__", "dataclasses")
        return {"modules": {name: {"loaded": name in sys.modules} for name in watched}}


class NumericTags:
    """Lists tags holding numpy and torch values, as an in-process store client would hand them over."""

    def kv_list(self) -> Any:
        import numpy as np
        import torch

        return {"train": {
            "np": {"global_steps": np.int64(3), "reward": np.float32(0.5), "ok": np.bool_(True),
                   "mask": np.arange(3), "status": "success"},
            "torch": {"score": torch.tensor(1.0), "ids": torch.tensor([[1, 2], [3, 4]]), "status": "success"},
            "complex": {"z": np.complex64(1 + 2j), "status": "success"},
        }}


class StrictClearSqlite:
    """The SQLite store with TransferQueue 0.1.8's ``kv_clear`` (0.1.9 made it idempotent).

    On 0.1.8 (tried on the released package) a clear naming any key that is
    already gone clears nothing at all (the controller logs an error and the
    client returns), and an empty key list is a ``ValueError``. The attribute
    ``clear_is_all_or_nothing`` tells the verl sampler so, as
    ``buffer.verl.link`` reads it. Everything else is the plain SQLite store.
    """

    clear_is_all_or_nothing = True

    def __init__(self, path: str, **kwargs: Any) -> None:
        from poller.sources.sqlite import SqliteSource

        self._store = SqliteSource(path, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def kv_clear(self, keys: list[str], partition_id: str) -> None:
        if not keys:
            raise ValueError("Received an empty list as keys.")
        held = self._store.kv_list(partition_id).get(partition_id, {})
        if all(key in held for key in keys):
            self._store.kv_clear(keys, partition_id)

    def close(self) -> None:
        self._store.close()


class ListedSqlite:
    """The SQLite store read without its change feed: only ``kv_list()``, a full listing every poll.

    A real file whose listing takes about a millisecond at a few keys: a cheap
    store without a change feed, as an in-memory store of one's own would be.
    """

    def __init__(self, path: str) -> None:
        from poller.sources.sqlite import SqliteSource

        self._store = SqliteSource(path)

    def kv_list(self) -> Any:
        return self._store.kv_list()

    def close(self) -> None:
        self._store.close()


class WatchedSqlite(ListedSqlite):
    """:class:`ListedSqlite` that also offers ``kv_watch``: a fingerprint of named keys, as TransferQueue's source.

    With ``failing_watch`` every ``kv_watch`` raises, as a store that refuses the request would.
    """

    def __init__(self, path: str, failing_watch: bool = False) -> None:
        super().__init__(path)
        self.failing_watch = failing_watch

    def kv_watch(self, partition_id: str, keys: list[str], timeout: float) -> Any:
        from poller.sources.contract import WatchRead

        if self.failing_watch:
            raise RuntimeError("this store refuses targeted reads")
        held = (self._store.kv_list() or {}).get(partition_id, {})
        found = {key: held[key] for key in keys if key in held}
        fingerprint = repr(sorted((key, sorted(tags.items())) for key, tags in found.items())).encode()
        return WatchRead(fingerprint, lambda: (len(found), found if len(found) == len(keys) else None))


class SlowListedSqlite(ListedSqlite):
    """:class:`ListedSqlite` whose every listing takes ``seconds`` more, as a large TransferQueue's does, and
    which clears keys (a verl sampler's client)."""

    def __init__(self, path: str, seconds: float) -> None:
        super().__init__(path)
        self.seconds = seconds

    def kv_list(self) -> Any:
        import time

        time.sleep(self.seconds)
        return super().kv_list()

    def kv_clear(self, keys: Any, partition_id: str) -> Any:
        """The sampler clears the batches it hands out through its own instance of the source."""
        return self._store.kv_clear(keys, partition_id)


class TimedListing:
    """A store without a change feed whose ``kv_list()`` takes ``seconds`` and logs when each call began.

    Each call appends ``"<time.monotonic()> <partitions listed>"`` to ``log``
    (CLOCK_MONOTONIC: the test process reads the same clock), so a test can
    count listings and measure the gaps between their starts. It holds one
    key in each of ``stored`` partitions and, like the TransferQueue source,
    lists only ``partition_ids`` when given (growing with ``include_partitions``).
    With ``stall`` every call raises :class:`~poller.sources.contract.SourceStall` after ``seconds``.
    """

    def __init__(self, log: str, seconds: float = 0.0, stored: tuple[str, ...] = ("train",),
                 partition_ids: list[str] | None = None, stall: bool = False) -> None:
        self.log = log
        self.seconds = seconds
        self.stall = stall  # give up after ``seconds``, as a source with a deadline does
        self.stored = stored
        self.partition_ids = partition_ids

    def include_partitions(self, partition_ids: list[str]) -> None:
        if self.partition_ids is not None:
            self.partition_ids += [p for p in partition_ids if p not in self.partition_ids]

    def kv_list(self) -> Any:
        import time

        listed = [p for p in self.stored if self.partition_ids is None or p in self.partition_ids]
        with open(self.log, "a") as f:
            f.write(f"{time.monotonic()!r} {','.join(listed)}\n")
        time.sleep(self.seconds)
        if self.stall:
            from poller.sources.contract import SourceStall

            raise SourceStall(f"no answer within {self.seconds}s")
        return {p: {f"{p}-key": {"global_steps": 1, "status": "success"}} for p in listed}


def listing_starts(log: str) -> list[tuple[float, list[str]]]:
    """The calls a :class:`TimedListing` logged: (monotonic start, partitions listed)."""
    try:
        with open(log) as f:
            lines = f.read().split("\n")[:-1]  # a line still being written is left out
    except FileNotFoundError:
        return []
    starts = []
    for line in lines:
        when, _, listed = line.partition(" ")
        starts.append((float(when), listed.split(",") if listed else []))
    return starts


def logged_transferqueue(log: str, **kwargs: Any) -> Any:
    """A :class:`~poller.sources.transferqueue.TransferQueueSource` that logs each ``kv_list()`` call.

    Each call appends ``"<monotonic start> <monotonic end>"`` to ``log`` when it
    returns (or raises), so a test reads when each listing of a real
    TransferQueue began and how long it took (:func:`timed_listings`).
    """
    import time

    from poller.sources.transferqueue import TransferQueueSource

    class Logged(TransferQueueSource):
        def kv_list(self) -> dict[str, Any]:
            began = time.monotonic()
            try:
                return super().kv_list()
            finally:
                with open(log, "a") as f:
                    f.write(f"{began!r} {time.monotonic()!r}\n")

    return Logged(**kwargs)


def timed_listings(log: str) -> list[tuple[float, float]]:
    """The calls :func:`logged_transferqueue` logged: (monotonic start, monotonic end)."""
    try:
        with open(log) as f:
            lines = f.read().split("\n")[:-1]  # a line still being written is left out
    except FileNotFoundError:
        return []
    return [(float(began), float(ended)) for began, ended in (line.split() for line in lines)]


class HalfChangeFeed:
    """Offers ``kv_changes`` without ``kv_snapshot``: half a change feed, refused when the source is loaded."""

    def kv_list(self) -> Any:
        return {}

    def kv_changes(self, cursor: Any) -> Any:
        return None


def nested_past_any_limit(kind: str, levels: int) -> Any:
    """A value ``levels`` deep: dicts (``{"x": {"x": ...}}``) or lists (``[[...]]``), built without recursion."""
    value: Any = {} if kind == "dict" else []
    for _ in range(levels):
        value = {"x": value} if kind == "dict" else [value]
    return value


class DeepTags:
    """Lists one key whose tag value is nested ``levels`` deep (what a custom store client or unpickled
    TransferQueue tags can hand over), beside keys that are fine; ``deep_too`` adds one each poll after it."""

    def __init__(self, kind: str = "dict", levels: int = 5000) -> None:
        self.deep = nested_past_any_limit(kind, levels)
        self.polls = 0

    def kv_list(self) -> Any:
        self.polls += 1
        fine = {"global_steps": 1, "status": "success"}
        return {"train": {"a": dict(fine), "deep": {**fine, "deep": self.deep}, f"later{self.polls}": dict(fine)}}
