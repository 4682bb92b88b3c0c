"""The ledger against a plain model: what the store says, minus what the trainer removed.

A Hypothesis state machine plays one source (a poller whose process may
restart) and a trainer against a real :class:`~buffer.store.PartitionStore`
(whose bookkeeping is the :class:`~buffer.ledger.Ledger`): the store's truth
changes, polls begin (any number of them on their way unreceived) and are
delivered in order as diffs or as full listings (also split in two, with a
removal between the parts), the trainer removes keys, the poller receives the
removals' marks (their tokens) late or never, the stream loses messages and
resyncs. After every step the keys held must be exactly the model's, and the
view must be whole exactly when the model says so.

The model, in plain words: the keys held are those the last delivered poll
listed, minus the removed ones. Each put gives a key a new version (its
tags). A removal hides the versions of the key removed (the one held and the
one listed). A poll began after it when it answers the removal's token (the
poller had received it when the poll began). The removal ends once a
delivered poll began after it and the store does not list a removed version;
a new version listed by a poll that began after the removal (or by any poll,
once one did) is shown; a new version listed by an earlier poll stays hidden
until a poll that began after it lists it still. A removal of a key the trainer
cleared in the store first hides whatever a poll that began before it lists,
and nothing a later one lists (the key was put again); it ends with the first
delivered poll that began after it.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from buffer.store import PartitionStore
from tests.helpers.deltas import apply

KEYS = st.sampled_from(["a", "b", "c", "d", "e"])
SOURCE = "own"
PART = "train"


@dataclass
class _Poll:
    number: int
    listing: dict[str, int]
    token: int  # the highest token the poller had received when it began


@dataclass
class _Removal:
    token: int
    versions: set[int]
    passed: bool = False   # a delivered poll began after it
    doubt: bool = False    # a new version was listed by a poll that may have begun before it
    cleared: bool = False  # the trainer cleared the key in the store before removing it


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = PartitionStore()
        self.store.require(SOURCE)
        self.issued: list[int] = []
        self.store.on_removed = self.issued.append
        self.truth: dict[str, int] = {}    # key -> its version
        self.former: dict[str, int] = {}   # key -> the version it had when last cleared
        self.version = 0
        self.epoch = 1
        self.store.announce(SOURCE, self.epoch)
        self.next_poll = 1
        self.received = 0                   # the highest token the poller received
        self.in_flight: list[_Poll] = []
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
        if key in self.truth:
            self.former[key] = self.truth.pop(key)

    @precondition(lambda self: bool(self.former))
    @rule(data=st.data())
    def put_back(self, data: st.DataObject) -> None:
        """A cleared key put again with the very tags it had (a writer retrying, a store rewound)."""
        key = data.draw(st.sampled_from(sorted(self.former)))
        self.truth[key] = self.former[key]

    @precondition(lambda self: len(self.in_flight) < 3)
    @rule()
    def begin_poll(self) -> None:
        self.in_flight.append(_Poll(self.next_poll, dict(self.truth), self.received))
        self.next_poll += 1

    @precondition(lambda self: bool(self.issued))
    @rule()
    def receive_marks(self) -> None:
        """The poller reads the removals' marks: the polls it begins from now on answer them."""
        self.received = max(self.received, self.issued[-1])

    @precondition(lambda self: bool(self.in_flight) and not self.must_be_full and not self.broken)
    @rule()
    def deliver_diff(self) -> None:
        """What changed since the last delivered poll: new keys, new versions, keys gone."""
        poll = self.in_flight.pop(0)
        apply(self.store, SOURCE, {PART: {key: {"v": version} for key, version in sorted(poll.listing.items())
                                          if self.sent.get(key) != version}},
              {PART: sorted(self.sent.keys() - poll.listing.keys())}, epoch=self.epoch, poll=poll.number, end=True,
              sync=poll.token)
        self._completed(poll)

    @precondition(lambda self: bool(self.in_flight))
    @rule(removed=st.none() | KEYS)
    def deliver_full(self, removed: str | None) -> None:
        """A full listing in two parts; the trainer may remove a key between them."""
        poll = self.in_flight.pop(0)
        listing = poll.listing
        keys = sorted(listing)
        first, second = keys[:len(keys) // 2], keys[len(keys) // 2:]
        apply(self.store, SOURCE, {PART: {key: {"v": listing[key]} for key in first}}, epoch=self.epoch,
              poll=poll.number, full=True, reset=True, sync=poll.token)
        self._listing(poll, first)
        if removed is not None:
            # Listed now: by the last poll, or by the first part of this one (then at its version).
            listed = {self.sent[removed]} if removed in self.sent else set()
            if removed in first:
                listed.add(listing[removed])
            self._remove(removed, listed)
        apply(self.store, SOURCE, {PART: {key: {"v": listing[key]} for key in second}}, epoch=self.epoch,
              poll=poll.number, full=True, end=True, sync=poll.token)
        self.broken = False
        self._completed(poll)

    @rule()
    def restart(self) -> None:
        """A new poller process: a new epoch, polls numbered from 1, a full listing first; it has no token yet."""
        self.store.abandon_snapshot(SOURCE)
        self.epoch += 1
        self.store.announce(SOURCE, self.epoch)
        self.next_poll = 1
        self.received = 0
        self.in_flight = []
        self.must_be_full = True

    @rule()
    def lose_messages(self) -> None:
        self.store.mark_broken(SOURCE)
        self.broken = True

    # -- the trainer ---------------------------------------------------------------------

    @rule(key=KEYS)
    def remove(self, key: str) -> None:
        self._remove(key, {self.sent[key]} if key in self.sent else set())

    @rule(key=KEYS)
    def clear_then_remove(self, key: str) -> None:
        """buffer.verl's clear: the key goes from the store, then from the view."""
        self.clear(key)
        self._remove(key, {self.sent[key]} if key in self.sent else set(), cleared=True)

    # -- the model -----------------------------------------------------------------------

    def _remove(self, key: str, listed: set[int], cleared: bool = False) -> None:
        issued = len(self.issued)
        self.store.remove(PART, [key], cleared=cleared)
        before = self.removals.get(key)
        versions = listed | (before.versions & listed if before is not None else set())
        assert len(self.issued) == issued + 1, "a removal with a stream to answer it issues a token"
        self.removals[key] = _Removal(self.issued[-1], versions, cleared=cleared)

    def _listing(self, poll: _Poll, keys: list[str]) -> None:
        """The part of ``poll`` listing ``keys`` was applied."""
        for key in keys:
            removal = self.removals.get(key)
            if removal is None or poll.listing[key] in removal.versions:
                continue
            if not (removal.passed or poll.token >= removal.token):
                removal.doubt = True

    def _completed(self, poll: _Poll) -> None:
        self._listing(poll, sorted(poll.listing))
        for key, removal in list(self.removals.items()):
            if poll.token >= removal.token:
                removal.passed = True
                removal.doubt = False
            if removal.passed and (removal.cleared or poll.listing.get(key) not in removal.versions):
                del self.removals[key]  # no listing begun before it may come, none lists what was removed
        self.sent = dict(poll.listing)
        self.completed = True
        self.must_be_full = False

    def _hidden(self, key: str) -> bool:
        removal = self.removals.get(key)
        if removal is not None and removal.cleared:
            return not removal.passed  # listed by a poll that began before the clear
        return removal is not None and (self.sent[key] in removal.versions or removal.doubt)

    @invariant()
    def holds_what_the_store_lists_minus_what_was_removed(self) -> None:
        held = self.store.snapshot(PART)
        expected = {key: {"v": version} for key, version in self.sent.items() if not self._hidden(key)}
        assert held == expected, (held, self.sent, self.removals)

    @invariant()
    def the_view_is_whole_exactly_when_the_model_says(self) -> None:
        whole = self.completed and not self.broken
        assert (self.store.view_gap(PART) is None) == whole, (self.store.view_gap(PART), self.completed, self.broken)


LedgerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_ledger_matches_its_model = LedgerMachine.TestCase
