"""What both processes share: the wire between a trainer and its pollers.

:mod:`buffer` and :mod:`poller` never import each other; both import this, which imports nothing
outside itself and nothing heavy (a poller imports it before it forks its watchdog).
"""
