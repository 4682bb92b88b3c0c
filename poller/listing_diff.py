"""Diffing a listing against what was sent, and recording what was sent.

Pure functions over dicts, shared by the polling thread (:mod:`poller.polling`)
and the change-feed reader (:mod:`poller.changes`).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

__all__ = ["Listing", "ListingDiff", "Tags", "commit_listing", "diff_raw_listing"]

Tags = dict[str, Any]
Listing = dict[str, dict[str, Tags]]


def diff_raw_listing(sent: Listing, raw: Any, full: bool, complete: bool = True) -> "ListingDiff":
    """Check a ``kv_list()`` result and diff it against ``sent``, in one pass over ``raw``.

    The diff holds the keys whose tags changed since ``sent`` (as fresh
    dicts; ``None`` tags are ``{}``) and, unless ``full``, the keys that
    vanished. With ``full`` every listed key is an upsert and nothing is a
    delete: the receiver works out what vanished from the snapshot itself,
    because after a restart this side no longer knows what it had sent.
    ``raw=None`` means nothing is stored. ``complete=False`` (a change set,
    not a listing): nothing is a delete, keys absent from ``raw`` are kept.

    Only changed tags are copied and checked; an unchanged key costs one
    lookup and one comparison in C, and nothing is built for it unless
    ``full`` (K=100k, 1% changed: 87 ms -> 39 ms per poll). ``sent`` is not
    modified; :func:`commit_listing` applies the diff once it was encoded.

    Raises:
        TypeError: ``raw`` is not ``{str: {str: mapping-with-str-keys}}``, with
            a message naming the first offending entry (a source error: it
            keeps garbage out of the stream instead of breaking it).
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise TypeError(f"kv_list() returned {type(raw).__name__}, expected a mapping of partitions")
    upserts: dict[str, dict[str, Tags]] = {}
    deletes: dict[str, list[str]] = {}
    listed: set[str] = set()
    for partition, items in raw.items():
        if not isinstance(partition, str):
            raise TypeError(f"kv_list() partition id {partition!r} is not a str")
        if items is None:
            continue
        if not isinstance(items, Mapping):
            raise TypeError(f"kv_list()[{partition!r}] is {type(items).__name__}, expected a mapping of keys")
        previous = sent.get(partition, {})
        changed: dict[str, Tags] = {}
        matched = 0
        for key, tags in items.items():
            held = previous.get(key)
            if held is not None:
                matched += 1
                if held == tags:  # checked when it was first held
                    if full:
                        changed[key] = held
                    continue
            if not isinstance(key, str):
                raise TypeError(f"kv_list()[{partition!r}] key {key!r} is not a str")
            if tags is None:
                tags = {}
            if type(tags) is not dict and not isinstance(tags, Mapping):
                raise TypeError(f"kv_list()[{partition!r}][{key!r}] tags are {type(tags).__name__}, expected a mapping")
            changed[key] = dict(tags)
        if items:
            listed.add(partition)
        if changed:
            upserts[partition] = changed
        if complete and not full and matched < len(previous):
            deletes[partition] = [key for key in previous if key not in items]
    if complete and not full:
        for partition, previous in sent.items():
            if partition not in listed and previous:
                deletes[partition] = list(previous)
    return ListingDiff(upserts, deletes)


def commit_listing(sent: Listing, diff: "ListingDiff", full: bool) -> None:
    """Make ``sent`` what the receiver holds once ``diff`` is applied."""
    if full:
        sent.clear()
        sent.update({partition: dict(items) for partition, items in diff.upserts.items()})
        return
    for partition, items in diff.upserts.items():
        sent.setdefault(partition, {}).update(items)
    for partition, keys in diff.deletes.items():
        held = sent.get(partition)
        if held is not None:
            for key in keys:
                held.pop(key, None)
            if not held:
                del sent[partition]


class ListingDiff(NamedTuple):
    """What changed between the last listing sent and the current one."""

    upserts: dict[str, dict[str, Tags]]
    deletes: dict[str, list[str]]

    def item_count(self) -> int:
        return sum(map(len, self.upserts.values())) + sum(map(len, self.deletes.values()))
