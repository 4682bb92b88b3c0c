"""Errors of the trainer side."""

from __future__ import annotations

__all__ = ["BufferClosed"]


class BufferClosed(Exception):
    """The buffer was closed (by you): it takes and gives nothing any more (:class:`poller.PollerCrashed`: it broke)."""
