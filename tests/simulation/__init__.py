"""A deterministic simulation of what decides the buffer's view, explored by a seeded scheduler.

The real code that decides what the buffer shows runs in one process, one step at a time: the SQLite store
(written through its API and by another tool), each poller's polling step (:meth:`poller.polling.PollingThread.poll`:
the source read, the diff, the encoding), the buffer's peer table (:class:`buffer.stream.PeerTable`: decoding,
sequence checks, resyncs), its store and ledger (:class:`buffer.store.PartitionStore`), read-your-writes
(:class:`buffer.sync.SyncRequest`) and ``sample()``'s decision (:class:`buffer.steps.StepSampler`). What is
simulated is only what lies between them: the network (messages queued, delivered, lost, a link cut), the
processes (stopped, killed, restarted) and the clock. No sockets, no threads, no sleeps.

:mod:`tests.simulation.world` is the world and its oracle (docs/how-it-works.md, "Guarantees and their bounds"),
:mod:`tests.simulation.explore` the scheduler, the shrinker and the command line::

    python -m tests.simulation --seeds 200            # make simulate SEEDS=200
    python -m tests.simulation --seed 17 --steps 400  # replay one seed, print its shrunk schedule
"""
