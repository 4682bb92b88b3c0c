"""#7 full-snapshot throughput: one whole listing moved and applied, on request."""

from __future__ import annotations

import time
from typing import Any, Callable

from buffer import ReplayBuffer
from buffer.sampling import SamplingAccess
from buffer.steps import StepSampler
from buffer.store import PartitionStore
from poller.diff import Diff
from poller.wire.protocol import DEFAULT_LIMITS, Kind, decode, encode_header, iter_encode_delta
from poller.wire.tags import unpack_many_tags

from .baselines import ceiling
from .baselines.mpqueue import MpQueueBuffer
from .overhead import SOURCE, UNBOUNDED, wait_for
from .report import Goal, Table, median
from .workload import SyntheticSource, make_listing

ITEM_BYTES_NOTE = "MB/s counts the bytes on the wire (msgpack) for the product and ceiling"


def _ask_resync(core: Any) -> None:
    """Have the buffer ask its poller for a RESYNC the way it does on a lost message: a gap in the sequence.

    Returns once the request went out (at the poller's next message, a heartbeat within 1 s).
    """
    table = core.receiver.table
    peer, asked = table.peers[core.name.encode()], table.resyncs_requested
    while table.resyncs_requested == asked:
        peer.next_seq -= 1  # written beside the receiver thread: a lost write is made again
        deadline = time.monotonic() + 5.0
        while table.resyncs_requested == asked and time.monotonic() < deadline:
            time.sleep(0.001)


def snapshot(progress: Callable[[str], None], quick: bool) -> Table:
    keys = 100_000 if quick else 1_000_000
    reps = 3 if quick else 5
    table = Table("7", f"full-snapshot throughput, K={keys:,}",
                  ["contender", "median s", "items/s", "MB/s", "product / contender"])
    progress(f"snapshot: product, {reps} resyncs of {keys:,} keys")
    rb = ReplayBuffer(source=SOURCE, source_kwargs={"keys": keys}, poll_interval=30.0,
                      start_timeout=300, listing_share=UNBOUNDED)
    wait_for(lambda: rb.stats()["polls"] >= 1, 600, "the first snapshot never arrived")
    try:
        times, sizes = [], []
        core = rb._core
        for _ in range(reps):
            before = rb.stats()
            _ask_resync(core)
            started = time.perf_counter()
            wait_for(lambda: rb.stats()["snapshots"] > before["snapshots"], 600, "no snapshot arrived")
            times.append(time.perf_counter() - started)
            sizes.append(rb.stats()["bytes_received"] - before["bytes_received"])
    finally:
        rb.close()
    product = median(times)
    product_bytes = median(sizes)
    progress(f"snapshot: ceiling, {reps} × {keys:,} keys")
    runs = [ceiling.snapshot_seconds(keys) for _ in range(reps)]
    ceiling_s = median([r[0] for r in runs])
    ceiling_bytes = median([r[1] for r in runs])
    progress(f"snapshot: mpqueue, {reps} × {keys:,} keys")
    mq = MpQueueBuffer(SyntheticSource, {"keys": keys}, poll_interval=600.0)
    try:
        mq.wait_polls(1)
        mq_times = []
        for _ in range(reps):
            polls = mq.polls
            started = time.perf_counter()
            mq.poll_now()
            mq.wait_polls(polls + 1)
            mq_times.append(time.perf_counter() - started)
    finally:
        mq.close()
    mpqueue = median(mq_times)
    progress("snapshot: the trainer's own share, in-process")
    floor = median([_trainer_share(keys) for _ in range(reps)])
    table.add("product (RESYNC -> applied)", product, keys / product, product_bytes / product / 1e6, 1.0)
    table.add("product's trainer share alone (decode + apply, no transport)", floor, keys / floor, "-",
              floor / product)
    table.add("ceiling (pre-packed, unpack only)", ceiling_s, keys / ceiling_s, ceiling_bytes / ceiling_s / 1e6,
              ceiling_s / product)
    table.add("mpqueue (request -> merged)", mpqueue, keys / mpqueue, "-", mpqueue / product)
    table.goals.append(Goal("product / ceiling (items/s)", ceiling_s / product, 0.8, higher_is_better=True))
    table.goals.append(Goal("product / mpqueue (items/s)", mpqueue / product, 2.0, higher_is_better=True))
    table.notes.append("a RESYNC (the buffer lost messages) is answered by the product's poller with what its "
                       "last poll sent, kept packed, in pieces of 4096 keys, without listing the source (the "
                       "store's changes since come with its next poll); mpqueue's request lists the source and "
                       "pickles the listing; the ceiling packs before its clock starts and does no checks, no "
                       "store and no index. A snapshot with a listing (a cold start, every key new) is #10's "
                       "'every key visible'")
    table.notes.append("the trainer-share row is the floor of this design: even with free transport and a free "
                       "poller, the trainer decodes the bodies and then finds, for every key, whether it holds it "
                       "with the same bytes and crosses it off the keys its stream listed before (C-level passes: "
                       "each a hash lookup into a table of K entries), which the ceiling does not do")
    table.notes.append(ITEM_BYTES_NOTE)
    table.notes.append("the synthetic source hands out its own tag dicts, so the store's cost is ~0 for the "
                       "product and mpqueue alike")
    return table


def _trainer_share(keys: int) -> float:
    """What the trainer must do per resync: decode the bodies, apply them to a store holding the keys."""
    listing = make_listing(keys)
    diff = Diff([listing], {}, full=True, limits=DEFAULT_LIMITS, size=4096)
    bodies = list(iter_encode_delta(diff, diff.deletes, poll=1, started=0.0, full=True,
                                    chunk_items=4096, max_frame_bytes=64 * 1024 * 1024))
    del listing, diff
    frames = [[encode_header(Kind.DELTA, 1, i), body] for i, body in enumerate(bodies)]
    store = PartitionStore()
    StepSampler(SamplingAccess(store))  # the policy ReplayBuffer attaches: its indexing is part of the cost

    def apply() -> None:
        for frame in frames:
            store.apply("bench", 1, decode(frame).body, unpack_many_tags)

    apply()  # the first snapshot: every key new
    started = time.perf_counter()
    apply()  # a resync: the keys held already
    return time.perf_counter() - started
