"""The wire between a trainer and its pollers: the protocol, the tag codec, the shared words, the errors, CURVE.

Both processes import it; it imports nothing outside itself and nothing heavy (a poller imports it before it
forks its watchdog).
"""
