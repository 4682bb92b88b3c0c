"""A process that owns a real local TransferQueue, driven by the tests.

The test process itself never imports Ray or TransferQueue: Ray's threads,
sockets and processes would defeat the leak checks, and a trainer-like
owner in a process of its own is also what the poller faces in production.
The host runs ``ray.init`` + ``tq.init`` (as the example trainer does) and
then executes ``kv_put`` / ``kv_batch_put`` / ``kv_clear`` / ``kv_list`` /
``close`` on request, over a multiprocessing pipe.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

_START_TIMEOUT = 240.0  # ray.init + tq.init on a loaded 2-core machine


class StoreHost:
    """The test side's handle on the host process."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child_conn,), name="tq-store-host", daemon=True)
        # One hash seed in the host: verl's sampler picks among groups of one global_steps in set order,
        # which a replayed differential seed must reproduce.
        saved = os.environ.get("PYTHONHASHSEED")
        os.environ["PYTHONHASHSEED"] = "0"
        try:
            self.process.start()
        finally:
            if saved is None:
                del os.environ["PYTHONHASHSEED"]
            else:
                os.environ["PYTHONHASHSEED"] = saved
        child_conn.close()
        self.call("ping", timeout=_START_TIMEOUT)

    def call(self, command: str, *args: Any, timeout: float = 120.0, **kwargs: Any) -> Any:
        """Run ``command`` in the host; re-raise its error here."""
        self._conn.send((command, args, kwargs))
        if not self._conn.poll(timeout):
            raise TimeoutError(f"store host gave no answer to {command} within {timeout}s")
        ok, value = self._conn.recv()
        if not ok:
            raise RuntimeError(f"store host failed at {command}:\n{value}")
        return value

    def stop(self, timeout: float = 120.0) -> int | None:
        try:
            self.call("stop", timeout=timeout)
        finally:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)
            self._conn.close()
        return self.process.exitcode


# -- in the host process -----------------------------------------------------------


class _Store:
    def __init__(self, temp_dir: str) -> None:
        from examples.verl_style_trainer import start_store

        self.conf = start_store(temp_dir=temp_dir)
        self.open = True
        self.closed_info: Any = None

    def ping(self) -> str:
        return "pong"

    def kwargs(self, from_ray: bool = False, **options: Any) -> dict[str, Any]:
        from poller.sources.transferqueue import source_kwargs

        return source_kwargs(None if from_ray else self.conf, **options)

    def put(self, key: str, partition_id: str, tag: dict | None = None, with_fields: bool = False) -> None:
        import transfer_queue as tq

        tq.kv_put(key, partition_id, fields=self._fields(1, with_fields, single=True), tag=tag)

    def batch_put(self, keys: list[str], partition_id: str, tags: list[dict], with_fields: bool = False) -> None:
        import transfer_queue as tq

        tq.kv_batch_put(keys, partition_id, fields=self._fields(len(keys), with_fields), tags=tags)

    @staticmethod
    def _fields(n: int, wanted: bool, single: bool = False) -> Any:
        if not wanted:
            return None
        import torch
        from tensordict import TensorDict

        if single:
            return {"responses": torch.arange(8)}
        return TensorDict({"responses": torch.arange(8 * n).reshape(n, 8)}, batch_size=[n])

    def run(self, target: str, **kwargs: Any) -> Any:
        """``module:function(conf, **kwargs)`` here, where TransferQueue is live (as in a verl trainer)."""
        import importlib

        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)(self.conf, **kwargs)

    def clear(self, keys: list[str], partition_id: str) -> None:
        import transfer_queue as tq

        tq.kv_clear(keys, partition_id)

    def list(self, partition_id: str | None = None) -> dict:
        import transfer_queue as tq

        return tq.kv_list(partition_id)

    def clear_all(self) -> None:
        for partition_id, items in self.list().items():
            if items:
                self.clear(list(items), partition_id)

    def close_tq(self) -> None:
        import transfer_queue as tq

        self.closed_info = self.conf.controller.zmq_info
        tq.close()
        self.open = False

    def after_controller_killed(self) -> None:
        """A test killed the TransferQueue controller: close the client side (bounded: it may wait on the dead
        controller) so that :meth:`ensure_open` starts a new one."""
        import transfer_queue as tq

        closing = threading.Thread(target=tq.close, daemon=True)
        closing.start()
        closing.join(30)
        self.open = False

    def ensure_open(self) -> None:
        """After a test closed TransferQueue: wait for the old controller to go, then init again."""
        if self.open:
            return
        import ray
        import transfer_queue as tq

        deadline = time.monotonic() + 60
        while True:
            try:
                ray.get_actor("TransferQueueController", namespace="transfer_queue")
            except ValueError:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("the closed TransferQueue controller is still registered after 60 s")
            time.sleep(0.2)
        self.conf = tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
        self.open = True

    def own_client_blocks(self, seconds: float) -> bool:
        """Is TransferQueue's own client still waiting after ``seconds`` on the closed controller?"""
        from transfer_queue.client import TransferQueueClient

        client = TransferQueueClient("blocked-probe", self.closed_info)
        done = threading.Event()

        def list_forever() -> None:
            try:
                client.kv_list()
            finally:
                done.set()

        # A daemon thread: if it blocks, it blocks until this process exits.
        threading.Thread(target=list_forever, daemon=True).start()
        return not done.wait(seconds)


def _serve(conn: Connection) -> None:
    parent = os.getppid()
    # Ray's socket paths must fit in 108 bytes; the tests' TMPDIR is deep.
    temp_dir = tempfile.mkdtemp(prefix="tq-host-", dir="/tmp")
    try:
        store = _Store(temp_dir)
    except BaseException:
        conn.send((False, traceback.format_exc()))
        os._exit(1)
    while True:
        # Exit with the test process, even if it was killed outright.
        if not conn.poll(0.5):
            if os.getppid() != parent:
                break
            continue
        try:
            command, args, kwargs = conn.recv()
        except EOFError:
            break
        if command == "stop":
            break
        try:
            conn.send((True, getattr(store, command)(*args, **kwargs)))
        except BaseException:
            conn.send((False, traceback.format_exc()))
    from examples.verl_style_trainer import stop_store

    try:
        stop_store()
        shutil.rmtree(temp_dir, ignore_errors=True)
    finally:
        try:
            conn.send((True, None))
        except OSError:
            pass
        # A probe thread may still be blocked in TransferQueue's client.
        os._exit(0)
