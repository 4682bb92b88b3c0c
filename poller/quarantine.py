"""Keys the wire cannot carry: screened out of each diff, named, counted, and let back in.

Runs in the poller process. The unit of failure is the record, not the listing: a key whose tags the receiver's
strict decoder would refuse (:class:`~poller.wire.protocol.Limits`; also a value that is not plain data, an int no
msgpack int holds), or whose key or partition id is not a ``str``, is *quarantined*: left out of the stream
(deleted from the receiver if it was sent), named in a rate-limited WARNING and counted, while every other key
flows. It comes back once its tags are valid, and leaves once deleted.

Values with one faithful plain form are converted instead: numpy and torch scalars (and 0-d tensors) to ``int`` /
``float`` / ``bool``, their arrays to nested lists, tuples to lists. Neither numpy nor torch is imported: such a
value is recognised by its type's module and read with its own ``item()`` / ``tolist()``. :func:`screen` is pure;
:class:`Quarantine` is the poller's memory of what it refused, reported in its heartbeats.
"""

from __future__ import annotations

import logging
import time
from itertools import chain, repeat
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from poller.wire.protocol import SCALAR_TYPES, Limits, Piece, packed_size
from poller.wire.sources import UnreadableValue
from poller.wire.tags import STR_ONLY, TAGS_DEPTH

__all__ = ["Refused", "Quarantine", "screen", "display_name", "MAX_REPORTED"]

logger = logging.getLogger(__name__)

#: How many quarantined keys a heartbeat names (the count is always whole).
MAX_REPORTED = 32
# Each name and reason is cut to this many characters in a report.
_NAME_CHARS = 200

# msgpack's integer range: uint64 above, int64 below.
_INT_MAX = 2**64 - 1
_INT_MIN = -(2**63)
# What iter_encode_delta puts around one key in the worst case, beyond its tags.
_FRAME_SLACK = 1024


class Refused(NamedTuple):
    """One key left out of the stream: its partition id and key as listed, and why."""

    partition: Any
    key: Any
    reason: str


def display_name(name: Any) -> str:
    """A name as it is reported: a ``str`` as it is, anything else as ``repr (type)``."""
    return name if isinstance(name, str) else f"{name!r} ({type(name).__name__})"


class _Refuse(Exception):
    """Raised inside the walk; carries the reason (the key's :class:`Refused` reason)."""


def _numeric(value: Any, limits: Limits, depth: int, budget: list[int]) -> Any:
    """A numpy or torch value's plain form (a scalar's number, an array's nested lists), else raises _Refuse."""
    module = type(value).__module__.partition(".")[0]
    if module not in ("numpy", "torch"):
        raise _Refuse(f"a {type(value).__module__}.{type(value).__qualname__} value is not plain data "
                      f"(str, int, float, bool, None, bytes, lists and maps)")
    try:
        shape = tuple(getattr(value, "shape", ()))
        plain = value.item() if shape == () else value.tolist()
    except Exception as exc:  # no Python form at all
        raise _Refuse(f"a {module} {type(value).__name__} has no plain value: {exc}") from None
    if shape == ():
        if type(plain) not in (int, float, bool):
            raise _Refuse(f"a {module} {type(value).__name__} holds a {type(plain).__name__}, not a number")
        return plain
    # An array's elements go through the same checks as any list (complex, str or object ones are refused).
    return _plain(plain, limits, depth, budget)


def _plain(value: Any, limits: Limits, depth: int, budget: list[int]) -> Any:
    """``value`` as plain data the receiver accepts (converted where faithful); raises _Refuse.

    ``budget`` holds how many more values the walk may visit: a structure shared with itself over and over
    (``a = [x, x]; b = [a, a]; ...``) would otherwise cost 2**depth, and a poller must never hang on a record.
    """
    budget[0] -= 1
    if budget[0] < 0:
        raise _Refuse(f"more than max_items={limits.max_items} values in all")
    kind = type(value)
    if kind is not str and isinstance(value, str):  # a StrEnum and the like: its plain text
        value, kind = str.__str__(value), str
    if kind is str:
        if len(value) * 4 > limits.max_str_len or not value.isascii():
            try:
                size = len(value.encode())
            except UnicodeEncodeError as exc:
                raise _Refuse(f"a string that is not valid UTF-8 ({exc.reason} at {exc.start})") from None
            if size > limits.max_str_len:
                raise _Refuse(f"a value of {size} bytes exceeds max_str_len={limits.max_str_len}")
        return value
    if kind is int:
        if not _INT_MIN <= value <= _INT_MAX:
            raise _Refuse(f"the int {_short(value)} fits no msgpack integer (-2**63 .. 2**64-1)")
        return value
    if kind in (float, bool) or value is None:
        return value
    if kind in (bytes, bytearray, memoryview):
        if len(value) > limits.max_str_len:
            raise _Refuse(f"a value of {len(value)} bytes exceeds max_str_len={limits.max_str_len}")
        return bytes(value) if kind is not bytes else value
    if isinstance(value, UnreadableValue):
        raise _Refuse(f"the source could not read a value: {value.reason}")
    if depth > limits.max_depth:
        raise _Refuse(f"nested deeper than max_depth={limits.max_depth}")
    if isinstance(value, Mapping):
        if len(value) > limits.max_items:
            raise _Refuse(f"a map of {len(value)} entries exceeds max_items={limits.max_items}")
        out = {}
        for name, item in value.items():
            if type(name) is not str:
                raise _Refuse(f"tag name {_short(name)} is {type(name).__name__}, not str")
            out[_plain(name, limits, depth + 1, budget)] = _plain(item, limits, depth + 1, budget)
        return out
    if isinstance(value, (list, tuple)):
        if len(value) > limits.max_items:
            raise _Refuse(f"a list of {len(value)} items exceeds max_items={limits.max_items}")
        return [_plain(item, limits, depth + 1, budget) for item in value]
    if isinstance(value, (int, float)) and not type(value).__module__.startswith(("numpy", "torch")):
        return int(value) if isinstance(value, int) else float(value)  # an IntEnum, a float subclass
    return _numeric(value, limits, depth, budget)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _plainly_fine(items: Mapping[str, Any], limits: Limits) -> bool:
    """The common case in C-level passes (flat scalars, str names, short ASCII); ``False``: "look closer" (~10x)."""
    if limits.max_depth <= TAGS_DEPTH:
        return False
    try:
        values = list(chain.from_iterable(map(dict.values, items.values())))
        names = set(chain.from_iterable(items.values()))  # tag names repeat from key to key: a small set
    except TypeError:  # tags that are Mappings but not dicts
        return False
    types = set(map(type, values))
    if not types <= SCALAR_TYPES or not set(map(type, names)) <= STR_ONLY:
        return False
    widest = max(map(len, items.values()), default=0)
    if widest > limits.max_items:
        return False
    if int in types:
        # isinstance, so bools come along: always in range, and a filter in C.
        ints = list(filter(int.__instancecheck__, values))
        if max(ints) > _INT_MAX or min(ints) < _INT_MIN:
            return False
    strings = set(filter(str.__instancecheck__, values)) if str in types else set()
    blobs = set(filter(bytes.__instancecheck__, values)) if bytes in types else set()
    # Non-ASCII text: its UTF-8 length and validity are checked per key.
    if not all(map(str.isascii, strings)) or not all(map(str.isascii, names)) or not all(map(str.isascii, items)):
        return False
    longest = max(max(map(len, names), default=0), max(map(len, strings), default=0),
                  max(map(len, blobs), default=0), max(map(len, items), default=0))
    if longest > limits.max_str_len:
        return False
    # The largest a key's tags could encode to: every name and value the longest.
    return widest * 2 * (longest + 9) + _FRAME_SLACK <= limits.max_frame_bytes


def _screen_tags(key: str, tags: Any, limits: Limits) -> Any:
    """The plain tags of one key; raises _Refuse naming what the wire cannot carry."""
    if len(key) * 4 > limits.max_str_len or not key.isascii():
        _plain(key, limits, TAGS_DEPTH, [1])
    plain = _plain(tags, limits, TAGS_DEPTH - 1, [limits.max_items])
    try:
        size = packed_size(plain)
    except (TypeError, ValueError, OverflowError) as exc:  # what the walk let through and msgpack did not
        raise _Refuse(f"msgpack cannot encode it: {exc}") from None
    if size + len(key) * 4 + _FRAME_SLACK > limits.max_frame_bytes:
        raise _Refuse(f"its tags encode to {size} bytes, over max_frame_bytes={limits.max_frame_bytes}")
    return plain


def screen(partition: str, items: dict[str, Any], refused: list[Refused], limits: Limits) -> bool:
    """Convert what converts, move what the receiver would refuse from ``items`` to ``refused``; True if changed."""
    if len(partition) * 4 > limits.max_str_len or not partition.isascii():
        try:
            _plain(partition, limits, TAGS_DEPTH, [1])
        except _Refuse as exc:
            refused.extend(Refused(partition, key, f"partition id: {exc}") for key in items)
            items.clear()
            return True
    if _plainly_fine(items, limits):
        return False
    for key in list(items):
        try:
            items[key] = _screen_tags(key, items[key], limits)
        except _Refuse as exc:
            del items[key]
            refused.append(Refused(partition, key, str(exc)))
    return True


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
        """Refused keys join; keys ``sent`` (:attr:`poller.diff.Diff.packed`) or deleted leave.

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
