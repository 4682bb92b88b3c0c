"""The self-pipe that wakes a waiting thread (poller.common.wakeup.WakePipe)."""

from __future__ import annotations

import os
import select

from poller.common.wakeup import WakePipe


def test_a_poke_after_close_writes_nowhere_not_into_a_file_that_reused_the_number() -> None:
    """A thread may poke after the owner closed the pipe (a waiting decision's watch ending after close())."""
    pipe = WakePipe()
    old_write = pipe.write_fd
    pipe.close()
    read_fd, write_fd = os.pipe()  # the lowest free numbers: the closed pipe's
    try:
        assert old_write in (read_fd, write_fd)
        pipe.poke()
        readable, _, _ = select.select([read_fd], [], [], 0.05)
        assert readable == []
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_poke_wakes_and_drain_empties() -> None:
    pipe = WakePipe()
    try:
        pipe.poke()
        assert select.select([pipe.read_fd], [], [], 1.0)[0] == [pipe.read_fd]
        pipe.drain()
        assert select.select([pipe.read_fd], [], [], 0.0)[0] == []
    finally:
        pipe.close()
        pipe.close()  # idempotent
