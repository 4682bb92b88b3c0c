"""The ledger against a plain model: what the store says, minus what the trainer removed.

A Hypothesis state machine plays one source (a poller whose process may
restart) and a trainer against a real :class:`~buffer.partitions.PartitionStore`
(whose bookkeeping is the :class:`~buffer.ledger.Ledger`): the store's truth
changes, polls begin (at most one under way, as the ledger assumes) and are
delivered as diffs or as full listings (also split in two, with a removal
between the parts), the trainer removes keys, the stream loses messages and
resyncs. After every step the keys held must be exactly the model's, and the
view must be whole exactly when the model says so.

The model, in plain words: the keys held are those the last delivered poll
listed, minus the removed ones. A removed key stays removed while the source
keeps listing it; the first delivered poll that does not list it ends that,
except that a poll which may have begun before the removal (numbered at most
one past the last poll anything was received of) does not end the removal of
a key that was not listed when it was removed.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from buffer.partitions import PartitionStore

KEYS = st.sampled_from(["a", "b", "c", "d", "e"])
SOURCE = "own"
PART = "train"


@dataclass
class _Removal:
    epoch: int
    horizon: int            # polls numbered above it (in the same epoch) began after the removal
    listed_then: bool       # listed when removed
    listed_since: bool = False


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.store = PartitionStore()
        self.store.require(SOURCE)
        self.truth: set[str] = set()
        self.epoch = 1
        self.next_poll = 1
        self.seen_poll = 0                  # highest poll of this epoch anything was received of
        self.in_flight: tuple[int, frozenset[str]] | None = None
        self.sent: set[str] = set()         # what the last delivered poll listed
        self.removals: dict[str, _Removal] = {}
        self.completed = False
        self.broken = False
        self.must_be_full = True            # a process's first poll is a full listing

    # -- the store and the source ------------------------------------------------------

    @rule(key=KEYS)
    def put(self, key: str) -> None:
        self.truth.add(key)

    @rule(key=KEYS)
    def clear(self, key: str) -> None:
        self.truth.discard(key)

    @precondition(lambda self: self.in_flight is None)
    @rule()
    def begin_poll(self) -> None:
        self.in_flight = (self.next_poll, frozenset(self.truth))
        self.next_poll += 1

    @precondition(lambda self: self.in_flight is not None and not self.must_be_full and not self.broken)
    @rule()
    def deliver_diff(self) -> None:
        assert self.in_flight is not None
        poll, listing = self.in_flight
        self._seen(poll)
        self.store.merge_listed(SOURCE, PART, {key: {"v": 1} for key in sorted(listing - self.sent)})
        self.store.unlist(SOURCE, PART, sorted(self.sent - listing))
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
        self.store.begin_snapshot(SOURCE)
        self.store.merge_listed(SOURCE, PART, {key: {"v": 1} for key in first})
        if removed is not None:
            # Listed now: by the last poll, or by the first part of this one.
            self._remove(removed, listed=removed in self.sent or removed in first)
        self.store.merge_listed(SOURCE, PART, {key: {"v": 1} for key in second})
        self.store.end_snapshot(SOURCE)
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
        self._remove(key, listed=key in self.sent)

    # -- the model -----------------------------------------------------------------------

    def _remove(self, key: str, listed: bool) -> None:
        self.store.remove(PART, [key])
        self.removals[key] = _Removal(self.epoch, self.seen_poll + 1, listed)

    def _seen(self, poll: int) -> None:
        self.store.poll_seen(SOURCE, self.epoch, poll)
        self.seen_poll = max(self.seen_poll, poll)

    def _completed(self, poll: int, listing: frozenset[str]) -> None:
        self.store.poll_completed(SOURCE, self.epoch, poll)
        for key, removal in list(self.removals.items()):
            if key in listing:
                removal.listed_since = True
                continue
            began_after = poll > (removal.horizon if removal.epoch == self.epoch else 1)
            if removal.listed_then or removal.listed_since or began_after:
                del self.removals[key]
        self.sent = set(listing)
        self.in_flight = None
        self.completed = True
        self.must_be_full = False

    @invariant()
    def holds_what_the_store_lists_minus_what_was_removed(self) -> None:
        held = set(self.store.snapshot(PART))
        assert held == self.sent - set(self.removals), (held, self.sent, self.removals)

    @invariant()
    def the_view_is_whole_exactly_when_the_model_says(self) -> None:
        whole = self.completed and not self.broken
        assert (self.store.view_gap(PART) is None) == whole, (self.store.view_gap(PART), self.completed, self.broken)


LedgerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
test_the_ledger_matches_its_model = LedgerMachine.TestCase
