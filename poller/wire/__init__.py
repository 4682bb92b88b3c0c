"""What both processes share: the wire between a trainer and its pollers.

The trainer (:mod:`buffer`) and the poller (:mod:`poller`) never import each other; both import
this. It imports nothing outside itself, and nothing heavy: a poller imports it before it forks
its watchdog.
"""
