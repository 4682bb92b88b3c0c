"""What a trainer and the poller it spawns both run beside the wire: the poller's configuration and the
lifeline it arrives on, the argument checks, the self-pipe and the ``/proc`` reads.

It imports :mod:`poller.wire` and the source contract (:mod:`poller.sources.contract`), nothing heavy.
"""
