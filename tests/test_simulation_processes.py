"""The simulation's companion with real processes: a ReplayBuffer whose poller is a real child process over a real
SQLite file, driven by Hypothesis' stateful testing. Fewer, slower schedules than tests/simulation; the same oracle
where it can be checked from outside: after each ``sync()`` the view equals the store (a tag the trainer added
aside), a version the trainer removed is never shown, and a record another tool wrote that cannot be read never
costs a restart or a source error.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import tempfile
import time
from contextlib import closing
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from buffer import ReplayBuffer
from poller.sources.sqlite import SqliteSource

PARTITIONS = st.sampled_from(["train", "val"])
KEYS = st.sampled_from(["k0", "k1", "k2", "k3"])
SOURCES = {"change-feed": "poller.sources.sqlite:SqliteSource", "listed": "tests.helpers.sources:ListedSqlite"}


def canonical(tags: dict[str, Any]) -> str:
    return json.dumps({name: value for name, value in tags.items() if name != "mark"}, sort_keys=True)


class BufferOverSqlite(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.directory = tempfile.mkdtemp(prefix="replay-sim-processes-")
        self.path = str(Path(self.directory) / "kv.db")
        self.api = SqliteSource(self.path)
        self.api.kv_list()
        self.rb: ReplayBuffer | None = None
        self.writes = 0
        self.removed: dict[tuple[str, str], set[str]] = {}

    @initialize(source=st.sampled_from(sorted(SOURCES)), poll_interval=st.sampled_from([0.02, 1.0]))
    def start(self, source: str, poll_interval: float) -> None:
        """The slowest and the fastest schedule, on a change feed and on a store listed in full."""
        self.rb = ReplayBuffer(source=SOURCES[source], source_kwargs={"path": self.path},
                               poll_interval=poll_interval)

    def teardown(self) -> None:
        try:
            if self.rb is not None:
                self.rb.close()
        finally:
            self.api.close()
            for name in os.listdir(self.directory):
                os.remove(os.path.join(self.directory, name))
            os.rmdir(self.directory)

    # -- the store ----------------------------------------------------------------------

    def _tags(self, status: str) -> dict[str, Any]:
        self.writes += 1
        return {"status": status, "global_steps": 1, "w": self.writes}

    @rule(partition=PARTITIONS, keys=st.lists(KEYS, min_size=1, max_size=3, unique=True),
          status=st.sampled_from(["running", "success"]))
    def put(self, partition: str, keys: list[str], status: str) -> None:
        try:
            self.api.kv_batch_put(keys, partition, tags=[self._tags(status) for _ in keys])
        except ValueError:
            pass  # a key whose stored tags another tool made unreadable is not merged into

    @rule(partition=PARTITIONS, keys=st.lists(KEYS, min_size=1, max_size=2, unique=True))
    def clear(self, partition: str, keys: list[str]) -> None:
        self.api.kv_clear(keys, partition)

    @rule(partition=PARTITIONS, key=KEYS, to=KEYS, kind=st.sampled_from(["rename", "not-json", "deep"]))
    def another_tool(self, partition: str, key: str, to: str, kind: str) -> None:
        """Another program renames a row, or writes one the store cannot read."""
        with closing(sqlite3.connect(self.path, timeout=10.0)) as conn, conn:
            if kind == "rename":
                if key != to and not conn.execute("SELECT 1 FROM kv WHERE partition_id = ? AND key = ?",
                                                  (partition, to)).fetchone():
                    conn.execute("UPDATE kv SET key = ? WHERE partition_id = ? AND key = ?", (to, partition, key))
            else:
                tags = "not json {" if kind == "not-json" else '{"a": ' * 3000 + "1" + "}" * 3000
                conn.execute("INSERT OR REPLACE INTO kv (partition_id, key, tags) VALUES (?, ?, ?)",
                             (partition, key, tags))

    # -- the trainer and its poller ---------------------------------------------------------

    @precondition(lambda self: self.rb is not None)
    @rule(partition=PARTITIONS, data=st.data())
    def remove(self, partition: str, data: st.DataObject) -> None:
        assert self.rb is not None
        held = self.rb.snapshot(partition)
        if not held:
            return
        key = data.draw(st.sampled_from(sorted(held)))
        self.removed.setdefault((partition, key), set()).add(canonical(held[key]))
        self.rb.remove(partition, [key])

    @precondition(lambda self: self.rb is not None)
    @rule(partition=PARTITIONS, data=st.data())
    def add(self, partition: str, data: st.DataObject) -> None:
        assert self.rb is not None
        held = self.rb.snapshot(partition)
        if held:
            self.rb.add(partition, {data.draw(st.sampled_from(sorted(held))): {"mark": self.writes}})

    @precondition(lambda self: self.rb is not None)
    @rule(seconds=st.sampled_from([0.2, 1.0]))
    def stop_the_poller(self, seconds: float) -> None:
        """SIGSTOP the poller for a while (a GC pause, a debugger), then SIGCONT."""
        assert self.rb is not None
        process = self.rb._core.process
        if process is None or process.pid is None:
            return
        os.kill(process.pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.kill(process.pid, signal.SIGCONT)

    @precondition(lambda self: self.rb is not None)
    @rule()
    def sync_and_compare(self) -> None:
        """Read your writes: the view equals the store, a removed version aside; nothing unreadable cost a restart."""
        assert self.rb is not None
        self.rb.sync(timeout=30)
        store = self._readable()
        view = {(partition, key): canonical(tags) for partition, items in self.rb.partitions.items()
                for key, tags in items.items()}
        expected = {name: tags for name, tags in store.items() if tags not in self.removed.get(name, ())}
        assert view == expected, (view, store, self.removed)
        stats = self.rb.stats()
        assert stats["source_errors"] == 0 and stats["restarts"] == 0, stats

    def _readable(self) -> dict[tuple[str, str], str]:
        with closing(sqlite3.connect(self.path)) as conn:
            rows = conn.execute("SELECT partition_id, key, CAST(tags AS BLOB) FROM kv").fetchall()
        readable = {}
        for partition, key, tags in rows:
            try:
                value = json.loads(tags)
            except (ValueError, RecursionError):
                continue
            if isinstance(value, dict):
                readable[(partition, key)] = canonical(value)
        return readable


BufferOverSqlite.TestCase.settings = settings(max_examples=10, stateful_step_count=25, deadline=None)
test_a_real_poller_keeps_the_view_equal_to_the_store = BufferOverSqlite.TestCase
