"""The ledger against a plain model: what the store says, minus what the trainer removed.

A Hypothesis state machine plays one source (a poller whose process may
restart) and a trainer against a real :class:`~buffer.partitions.PartitionStore`
(whose bookkeeping is the :class:`~buffer.partitions.Ledger`): the store's truth
changes, polls begin (at most one under way, as the ledger assumes) and are
delivered as diffs or as full listings (also split in two, with a removal
between the parts), the trainer removes keys, the stream loses messages and
resyncs. After every step the keys held must be exactly the model's, and the
view must be whole exactly when the model says so.

The model, in plain words: the keys held are those the last delivered poll
listed, minus the removed ones. Each put gives a key a new version (its
tags). A removal hides the versions of the key removed (the one held). It
ends when a delivered poll does not list the key (except that such a poll
that may have begun before the removal, numbered at most one past the last
poll anything was received of, does not end the removal of a key that was not
listed when it was removed), or when a poll begun after the removal lists a
version not removed: a new record. A new version listed by a poll that may
have begun before the removal stays hidden until such a poll.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from buffer.partitions import PartitionStore
from tests.helpers.deltas import apply

KEYS = st.sampled_from(["a", "b", "c", "d", "e"])
SOURCE = "own"
PART = "train"


@dataclass
class _Removal:
    epoch: int
    horizon: int            # polls numbered above it (in the same epoch) began after the removal
    listed_then: bool       # listed when removed
    versions: set[int]      # the versions of the key removed
    listed_since: bool = False

    def began_after(self, epoch: int, poll: int) -> bool:
        return poll > (self.horizon if self.epoch == epoch else 1)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = PartitionStore()
        self.store.require(SOURCE)
        self.truth: dict[str, int] = {}    # key -> its version
        self.version = 0
        self.epoch = 1
        self.next_poll = 1
        self.seen_poll = 0                  # highest poll of this epoch anything was received of
        self.in_flight: tuple[int, dict[str, int]] | None = None
        self.sent: dict[str, int] = {}      # what the last delivered poll listed
        self.removals: dict[str, _Removal] = {}
        self.completed = False
        self.broken = False
        self.must_be_full = True            # a process's first poll is a full listing

    # -- the store and the source ------------------------------------------------------

    @rule(key=KEYS)
    def put(self, key: str) -> None:
        """A new version of ``key`` (updated in place, or put anew)."""
        self.version += 1
        self.truth[key] = self.version

    @rule(key=KEYS)
    def clear(self, key: str) -> None:
        self.truth.pop(key, None)

    @precondition(lambda self: self.in_flight is None)
    @rule()
    def begin_poll(self) -> None:
        self.in_flight = (self.next_poll, dict(self.truth))
        self.next_poll += 1

    @precondition(lambda self: self.in_flight is not None and not self.must_be_full and not self.broken)
    @rule()
    def deliver_diff(self) -> None:
        """What changed since the last delivered poll: new keys, new versions, keys gone."""
        assert self.in_flight is not None
        poll, listing = self.in_flight
        self._seen(poll)
        apply(self.store, SOURCE, {PART: {key: {"v": version} for key, version in sorted(listing.items())
                                          if self.sent.get(key) != version}},
              {PART: sorted(self.sent.keys() - listing.keys())}, epoch=self.epoch, poll=poll, end=True)
        self._completed(poll, listing)

    @precondition(lambda self: self.in_flight is not None)
    @rule(removed=st.none() | KEYS)
    def deliver_full(self, removed: str | None) -> None:
        """A full listing in two parts; the trainer may remove a key between them."""
        assert self.in_flight is not None
        poll, listing = self.in_flight
        keys = sorted(listing)
        first, second = keys[:len(keys) // 2], keys[len(keys) // 2:]
        self._seen(poll)
        apply(self.store, SOURCE, {PART: {key: {"v": listing[key]} for key in first}}, epoch=self.epoch, poll=poll,
              full=True, reset=True)
        if removed is not None:
            # Listed now: by the last poll, or by the first part of this one (then at its version).
            listed = {self.sent[removed]} if removed in self.sent else set()
            if removed in first:
                listed.add(listing[removed])
            self._remove(removed, listed)
        apply(self.store, SOURCE, {PART: {key: {"v": listing[key]} for key in second}}, epoch=self.epoch, poll=poll,
              full=True, end=True)
        self.broken = False
        self._completed(poll, listing)

    @rule()
    def restart(self) -> None:
        """A new poller process: a new epoch, polls numbered from 1, a full listing first."""
        self.store.abandon_snapshot(SOURCE)
        self.epoch += 1
        self.next_poll, self.seen_poll = 1, 0
        self.in_flight = None
        self.must_be_full = True

    @rule()
    def lose_messages(self) -> None:
        self.store.mark_broken(SOURCE)
        self.broken = True

    # -- the trainer ---------------------------------------------------------------------

    @rule(key=KEYS)
    def remove(self, key: str) -> None:
        self._remove(key, {self.sent[key]} if key in self.sent else set())

    # -- the model -----------------------------------------------------------------------

    def _remove(self, key: str, listed: set[int]) -> None:
        self.store.remove(PART, [key])
        before = self.removals.get(key)
        versions = listed | (before.versions if before is not None else set())
        self.removals[key] = _Removal(self.epoch, self.seen_poll + 1, bool(listed), versions)

    def _seen(self, poll: int) -> None:
        self.seen_poll = max(self.seen_poll, poll)

    def _completed(self, poll: int, listing: dict[str, int]) -> None:
        began_after = {key: removal.began_after(self.epoch, poll) for key, removal in self.removals.items()}
        for key, removal in list(self.removals.items()):
            if key in listing:
                if listing[key] not in removal.versions and began_after[key]:
                    del self.removals[key]  # a new record of the name, listed after the removal
                else:
                    removal.listed_since = True  # removed, or in doubt (listed by a poll under way)
                continue
            if removal.listed_then or removal.listed_since or began_after[key]:
                del self.removals[key]
        self.sent = dict(listing)
        self.in_flight = None
        self.completed = True
        self.must_be_full = False

    @invariant()
    def holds_what_the_store_lists_minus_what_was_removed(self) -> None:
        held = self.store.snapshot(PART)
        expected = {key: {"v": version} for key, version in self.sent.items() if key not in self.removals}
        assert held == expected, (held, self.sent, self.removals)

    @invariant()
    def the_view_is_whole_exactly_when_the_model_says(self) -> None:
        whole = self.completed and not self.broken
        assert (self.store.view_gap(PART) is None) == whole, (self.store.view_gap(PART), self.completed, self.broken)


LedgerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_ledger_matches_its_model = LedgerMachine.TestCase
