"""What both processes share: the wire between a trainer and its pollers.

The trainer (:mod:`buffer`) and the poller (:mod:`poller`) never import each
other; both import this: the messages and their frames, the tag codec, the
lifeline, the poller's configuration, the source contract, CURVE, the errors
and the argument checks. It imports nothing outside itself, and nothing heavy
when imported: a poller imports it before it forks its watchdog.
"""
