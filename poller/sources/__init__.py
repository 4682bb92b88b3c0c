"""The store clients: SQLite (the embedded default) and TransferQueue, held to one contract
(:mod:`poller.sources.contract`).

A poller lists them; a trainer writes through the same ones (``buffer.verl`` clears prompts, the demo puts
rows). Each is named by spec (``"poller.sources.sqlite:SqliteSource"``).
"""
