"""The pipe's limit: raw pyzmq over ipc, messages packed before the clock starts.

A sender process packs the listing into the same chunks the poller sends
(4096 items, ``{partition: {key: tags}}``) and waits; on ``go`` it sends
them back to back. The trainer side receives each frame without copying and
unpacks it with msgpack: the least a trainer must do to hold the items as
Python objects. No checks, no store, no index.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import msgpack
import zmq

CHUNK = 4096


def _sender(endpoint: str, keys: int) -> None:
    from bench.workload import make_listing

    frames = []
    chunk: dict = {}
    n = 0
    for partition, items in make_listing(keys).items():
        for key, tags in items.items():
            chunk.setdefault(partition, {})[key] = tags
            n += 1
            if n % CHUNK == 0:
                frames.append(msgpack.packb(chunk))
                chunk = {}
    if chunk:
        frames.append(msgpack.packb(chunk))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send(b"ready")
    sock.recv()  # go
    for frame in frames:
        sock.send(frame, copy=False)
    sock.send(b"end")
    sock.recv()  # done
    sock.close(0)
    ctx.term()


def snapshot_seconds(keys: int) -> tuple[float, int]:
    """Seconds to move ``keys`` items, and the bytes moved."""
    directory = tempfile.mkdtemp(prefix="bench-ceiling-")
    endpoint = f"ipc://{directory}/s"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    code = f"from bench.baselines.ceiling import _sender; _sender({endpoint!r}, {keys})"
    child = subprocess.Popen([sys.executable, "-c", code], cwd=os.getcwd(),
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        if not sock.poll(300_000):
            raise TimeoutError("the ceiling sender never became ready")
        identity, _ = sock.recv_multipart()
        started = time.perf_counter()
        sock.send_multipart([identity, b"go"])
        received = 0
        while True:
            _, frame = sock.recv_multipart(copy=False)
            if frame.bytes == b"end":
                break
            msgpack.unpackb(frame.buffer)
            received += len(frame.buffer)
        elapsed = time.perf_counter() - started
        sock.send_multipart([identity, b"done"])
        child.wait(30)
        return elapsed, received
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        sock.close(0)
        ctx.term()
        if os.path.isdir(directory) and not os.listdir(directory):
            os.rmdir(directory)
