"""The quarantine: the keys the wire cannot carry, held back while every other key flows.

A key the screen refuses (:func:`poller.wire.tags.screen`, :attr:`poller.diff.Diff.refused`) is left out of the
stream (deleted from the receiver if sent), named in a rate-limited WARNING and counted in heartbeats; it comes back
once its tags are valid, and leaves once deleted.
"""

from __future__ import annotations

import logging
import time
from itertools import repeat
from typing import Any, Iterable, Mapping, Sequence

from poller.wire.protocol import Piece
from poller.wire.tags import STR_ONLY, Refused

__all__ = ["MAX_REPORTED", "Quarantine", "display_name"]

logger = logging.getLogger(__name__)

#: How many quarantined keys a heartbeat names (the count is always whole).
MAX_REPORTED = 32
# Each name and reason is cut to this many characters in a report.
_NAME_CHARS = 200


def display_name(name: Any) -> str:
    """A name as it is reported: a ``str`` as it is, anything else as ``repr (type)``."""
    return name if isinstance(name, str) else f"{name!r} ({type(name).__name__})"


class Quarantine:
    """What the poller left out of the stream, for its heartbeats and its log.

    :meth:`replace` after a complete listing, :meth:`update` after a change set. Keys are held as the source named
    them (a non-``str`` too, so that its delete finds it).
    """

    def __init__(self, *, warnings_per_minute: int = 20) -> None:
        self.keys: dict[tuple[Any, Any], str] = {}
        self._budget = warnings_per_minute
        self._window: tuple[float, int] = (time.monotonic(), 0)
        self.changes = 0  # bumped whenever the set changes, so the poller reports at once
        self.ignored_deletes = 0  # deletes of names no stream carries, never quarantined (see update)

    def replace(self, refused: Iterable[Refused]) -> None:
        now = {(r.partition, r.key): r.reason for r in refused}
        entered = [(pk, reason) for pk, reason in now.items() if self.keys.get(pk) != reason]
        left = [pk for pk in self.keys if pk not in now]
        self.keys = now
        self._report(entered, left)

    def update(self, refused: Iterable[Refused], sent: Piece, deleted: Mapping[Any, Iterable[Any]]) -> None:
        """Refused keys join; keys ``sent`` (:attr:`Diff.packed`) or deleted leave.

        ``deleted``: the change set's deletes as the source gave them. A delete of a name no stream carries (not a
        ``str``) lets the record go if it was quarantined, else is counted (:attr:`ignored_deletes`).
        """
        entered = []
        for r in refused:
            pk = (r.partition, r.key)
            if self.keys.get(pk) != r.reason:
                self.keys[pk] = r.reason
                entered.append((pk, r.reason))
        left: dict[tuple[Any, Any], None] = {}
        ignored: list[tuple[Any, Any]] = []
        for partition, keys in deleted.items():
            if isinstance(partition, str) and set(map(type, keys)) <= STR_ONLY:  # the usual case, in one C-level pass
                if self.keys:
                    left.update(dict.fromkeys(pk for pk in zip(repeat(partition), keys) if pk in self.keys))
                continue
            for key in keys:
                pk = (partition, key)
                try:
                    held = pk in self.keys
                except TypeError:  # unhashable: no quarantined name equals it
                    held = False
                if held:
                    left[pk] = None
                elif not (isinstance(partition, str) and isinstance(key, str)):
                    ignored.append(pk)
        if self.keys:
            left.update(dict.fromkeys(pk for partition, (keys, _) in sent.items()
                                      for pk in zip(repeat(partition), keys) if pk in self.keys))
        for pk in left:
            del self.keys[pk]
        self._report(entered, list(left), ignored)

    def names(self, limit: int = MAX_REPORTED) -> list[list[str]]:
        """Up to ``limit`` ``[partition, key, reason]``, each cut to a bounded length."""
        return [[display_name(partition)[:_NAME_CHARS], display_name(key)[:_NAME_CHARS], reason[:_NAME_CHARS]]
                for (partition, key), reason in list(self.keys.items())[:limit]]

    def _report(self, entered: list[tuple[tuple[Any, Any], str]], left: list[tuple[Any, Any]],
                ignored: Sequence[tuple[Any, Any]] = ()) -> None:
        if ignored:
            self.ignored_deletes += len(ignored)
            # Not a change of the quarantine: logged (within the budget), not reported in a heartbeat.
            partition, key = ignored[0]
            self._log(logging.INFO, "ignored %d delete(s) of keys no stream carries (first: %s/%s; %d in all "
                      "since the poller started): they were never streamed", len(ignored),
                      display_name(partition), display_name(key), self.ignored_deletes)
        if not entered and not left:
            return
        self.changes += 1
        shown = entered[:max(0, min(5, self._left_in_budget()))]
        for (partition, key), reason in shown:
            self._log(logging.WARNING, "quarantined %s/%s: %s; the key is left out of the stream until its tags "
                      "are valid (every other key keeps flowing)", display_name(partition), display_name(key),
                      reason)
        if len(entered) > len(shown):
            self._log(logging.WARNING, "quarantined %d more key(s) (%d in all; see stats()['quarantined_keys'])",
                      len(entered) - len(shown), len(self.keys))
        if left:
            logger.info("%d key(s) left the quarantine (valid again or cleared); %d remain", len(left),
                        len(self.keys))

    def _left_in_budget(self) -> int:
        """Log lines this minute's budget still allows."""
        if time.monotonic() - self._window[0] >= 60.0:
            self._window = (time.monotonic(), 0)
        return self._budget - self._window[1]

    def _log(self, level: int, message: str, *args: Any) -> None:
        """Log at ``level`` while this minute's budget lasts, then at DEBUG."""
        over = self._left_in_budget() <= 0
        logger.log(logging.DEBUG if over else level, message, *args)
        if not over:
            self._window = (self._window[0], self._window[1] + 1)
