"""The stores a poller lists: SQLite (the embedded default) and TransferQueue.

Each is named by spec (``"poller.sources.sqlite:SqliteSource"``); what a source must and may offer is
:mod:`poller.wire.sources`.
"""
