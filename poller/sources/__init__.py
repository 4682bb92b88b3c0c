"""The stores a poller lists: SQLite (the embedded default) and TransferQueue.

Each is named by spec (``"poller.sources.sqlite:SqliteSource"``); the contract is :mod:`poller.wire.sources`.
"""
