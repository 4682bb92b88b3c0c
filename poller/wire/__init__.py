"""What both processes share: the wire between a trainer and its pollers.

The trainer (:mod:`buffer`) and the poller process (:mod:`poller`) import
each other never; both import this subpackage: the message records and their
frames, the tag codec, the lifeline's records, the poller's configuration,
the source contract (sources are named by spec), CURVE keys, the errors, and
the argument checks both ends apply. It imports nothing outside itself, and
nothing heavy when imported: a poller imports it before it forks its
watchdog.
"""
