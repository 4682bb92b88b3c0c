"""Two hosts on one machine: network namespaces joined by a veth pair.

::

    netns "<run>-a" (trainer)              netns "<run>-b" (poller host)
      lo, <veth>a 10.77.0.1/30  ◀── veth ──▶  <veth>b 10.77.0.2/30, lo

Nothing is attached to the root namespace, so no traffic leaves the two
namespaces. Names carry the pid and a random token, so parallel runs never
collide; :meth:`NetnsPair.close` kills what still runs inside and deletes
both namespaces (the veth pair goes with them).

The trainer side is entered per *thread* (``setns`` changes only the calling
thread's namespace): a :class:`~buffer.ReplayBuffer` constructed inside
:meth:`NetnsPair.trainer_side` creates its receiver thread, its ZeroMQ I/O
threads and its listening socket there, while the test itself stays in the
root namespace. Pollers run as ``ip netns exec <b> python -m poller run``.
"""

from __future__ import annotations

import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
from contextlib import contextmanager
from typing import Iterator, Sequence

__all__ = ["NetnsPair", "netns_unavailable"]

TRAINER_IP = "10.77.0.1"
POLLER_IP = "10.77.0.2"
_CLONE_NEWNET = 0x40000000


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None if they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' tool (iproute2) is not installed"
    probe = f"rp-probe-{os.getpid()}-{secrets.token_hex(3)}"
    result = _ip("netns", "add", probe)
    if result.returncode != 0:
        return f"cannot create a network namespace: {result.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


_OURS = re.compile(r"^rp-(\d+)-[0-9a-f]{6}-[ab]$")


def _delete_orphans() -> None:
    """Delete namespaces left by a test run that was killed before it could clean up."""
    for line in _ip("netns", "list").stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        match = _OURS.match(name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            _ip("netns", "del", name)


class NetnsPair:
    """Namespaces ``a`` (trainer) and ``b`` (poller host) and the veth pair between them."""

    def __init__(self) -> None:
        token = secrets.token_hex(3)
        self.a = f"rp-{os.getpid()}-{token}-a"
        self.b = f"rp-{os.getpid()}-{token}-b"
        self.veth_a = f"rv{token}a"  # interface names: at most 15 bytes
        self.veth_b = f"rv{token}b"
        self.trainer_ip = TRAINER_IP
        self.poller_ip = POLLER_IP
        self._made: list[str] = []

    def create(self) -> "NetnsPair":
        _delete_orphans()
        try:
            for ns in (self.a, self.b):
                self._run("netns", "add", ns)
                self._made.append(ns)
            # Created directly inside the namespaces: never visible in the root one.
            self._run("link", "add", self.veth_a, "netns", self.a, "type", "veth",
                      "peer", "name", self.veth_b, "netns", self.b)
            for ns, dev, ip in ((self.a, self.veth_a, self.trainer_ip), (self.b, self.veth_b, self.poller_ip)):
                self._run("-n", ns, "addr", "add", f"{ip}/30", "dev", dev)
                self._run("-n", ns, "link", "set", "lo", "up")
                self._run("-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise
        return self

    def _run(self, *args: str) -> None:
        result = _ip(*args)
        if result.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")

    def set_link(self, up: bool) -> None:
        """Bring the poller host's end of the veth down (a cut cable) or up again."""
        self._run("-n", self.b, "link", "set", self.veth_b, "up" if up else "down")

    def in_poller_host(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the poller host's namespace."""
        return ["ip", "netns", "exec", self.b, *argv]

    @contextmanager
    def trainer_side(self) -> Iterator[None]:
        """Run the block, and the threads it starts, in the trainer's namespace."""
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"/run/netns/{self.a}", os.O_RDONLY)
            try:
                _setns(target)
                try:
                    yield
                finally:
                    _setns(home)
            finally:
                os.close(target)
        finally:
            os.close(home)

    def close(self) -> None:
        """Kill whatever still runs inside, then delete both namespaces. Idempotent."""
        for ns in self._made:
            pids = _ip("netns", "pids", ns).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
        for ns in self._made:
            _ip("netns", "del", ns)
        self._made.clear()

    def exists(self) -> bool:
        listed = _ip("netns", "list").stdout
        return any(line.split()[0] in (self.a, self.b) for line in listed.splitlines() if line.strip())
