"""SqliteSource: TransferQueue's KV semantics on a real SQLite file, across processes."""

from __future__ import annotations

import math
import multiprocessing
import sqlite3
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from poller.sources.contract import load_source
from poller.sources.sqlite import SqliteSource
from poller.wire.vocabulary import UnreadableValue
from tests.helpers.sources import nested_past_any_limit

JOIN_TIMEOUT = 30.0


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "kv.db"


@pytest.fixture
def store(db: Path) -> Iterator[SqliteSource]:
    with SqliteSource(db) as source:
        yield source


def test_constructor_is_lazy_and_creates_the_file_on_first_use(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "dir" / "kv.db"
    source = SqliteSource(path)
    try:
        assert not path.exists()
        assert source.kv_list() == {}
        assert path.exists()
    finally:
        source.close()


def test_wal_mode_and_schema(store: SqliteSource, db: Path) -> None:
    store.kv_list()
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'kv'").fetchone()[0]
    finally:
        conn.close()
    assert "WITHOUT ROWID" in sql
    assert "PRIMARY KEY (partition_id, key)" in sql


def test_put_then_list(store: SqliteSource) -> None:
    store.kv_put("k1", "train", tag={"global_steps": 1, "status": "running"})
    store.kv_put("k2", "train", fields={"not_a_tag": True}, tag={"global_steps": 1, "nested": {"a": [1, 2.5, None]}})
    store.kv_put("k3", "val")
    assert store.kv_list() == {
        "train": {
            "k1": {"global_steps": 1, "status": "running"},
            "k2": {"global_steps": 1, "nested": {"a": [1, 2.5, None]}},
        },
        "val": {"k3": {}},
    }


def test_merge_on_put_keeps_global_steps(store: SqliteSource) -> None:
    store.kv_put("k1", "train", tag={"global_steps": 7, "status": "running"})
    # The rollout worker's tag has no global_steps: it must come from the marker.
    store.kv_put("k1", "train", tag={"status": "success", "written_at": 1.5})
    assert store.kv_list() == {"train": {"k1": {"global_steps": 7, "status": "success", "written_at": 1.5}}}
    # tag=None leaves the tags alone.
    store.kv_put("k1", "train")
    assert store.kv_list()["train"]["k1"] == {"global_steps": 7, "status": "success", "written_at": 1.5}


def test_merge_is_top_level_only(store: SqliteSource) -> None:
    store.kv_put("k1", "p", tag={"meta": {"a": 1, "b": 2}})
    store.kv_put("k1", "p", tag={"meta": {"c": 3}})
    assert store.kv_list("p") == {"p": {"k1": {"meta": {"c": 3}}}}


def test_batch_put(store: SqliteSource) -> None:
    keys = [f"k{i}" for i in range(1200)]  # more than one IN (...) chunk
    store.kv_batch_put(keys, "train", tags=[{"global_steps": 3, "status": "running"} for _ in keys])
    store.kv_batch_put(keys[::2], "train", tags=[{"status": "success"} for _ in keys[::2]])
    listing = store.kv_list()
    assert list(listing) == ["train"]
    assert len(listing["train"]) == len(keys)
    for i, key in enumerate(keys):
        expected = "success" if i % 2 == 0 else "running"
        assert listing["train"][key] == {"global_steps": 3, "status": expected}


def test_batch_put_without_tags_and_repeated_keys(store: SqliteSource) -> None:
    store.kv_batch_put(["a", "b"], "p")
    assert store.kv_list() == {"p": {"a": {}, "b": {}}}
    store.kv_batch_put(["a", "a"], "p", tags=[{"x": 1, "y": 1}, {"y": 2}])
    assert store.kv_list("p")["p"]["a"] == {"x": 1, "y": 2}
    store.kv_batch_put([], "p", tags=[])
    assert store.kv_list("p")["p"] == {"a": {"x": 1, "y": 2}, "b": {}}


def test_batch_put_length_mismatch(store: SqliteSource) -> None:
    with pytest.raises(ValueError, match="2 tags for 3 keys"):
        store.kv_batch_put(["a", "b", "c"], "p", tags=[{}, {}])
    assert store.kv_list() == {}


def test_clear(store: SqliteSource) -> None:
    store.kv_batch_put(["a", "b", "c"], "p", tags=[{"n": 1}, {"n": 2}, {"n": 3}])
    store.kv_batch_put(["a"], "q", tags=[{"n": 4}])
    store.kv_clear(["a", "missing"], "p")
    assert store.kv_list() == {"p": {"b": {"n": 2}, "c": {"n": 3}}, "q": {"a": {"n": 4}}}
    store.kv_clear([], "p")
    store.kv_clear(["a"], "nowhere")
    assert store.kv_list("q") == {"q": {"a": {"n": 4}}}


def test_fields_are_kept_apart_from_tags_and_read_back(store: SqliteSource) -> None:
    info = {"reward_extra_info": {"acc": 1.0}}
    store.kv_put("u_0_0", "train", fields={"extra_fields": info, "score": 2}, tag={"status": "success"})
    # Columns, as TransferQueue's TensorDict: one value per key.
    store.kv_batch_put(["u_1_0", "u_2_0"], "train", fields={"extra_fields": [{"reward_extra_info": {"acc": 0.0}}, {}]},
                       tags=[{"status": "success"}, {"status": "success"}])
    store.kv_put("u_2_0", "train", fields={"score": 7})  # merged per field name, tags untouched
    assert store.kv_list() == {"train": {k: {"status": "success"} for k in ("u_0_0", "u_1_0", "u_2_0")}}
    got = store.kv_batch_get(["u_2_0", "u_0_0", "u_1_0"], "train", select_fields=["extra_fields"])
    assert got == {"extra_fields": [{}, info, {"reward_extra_info": {"acc": 0.0}}]}
    assert store.kv_batch_get(["u_0_0", "u_1_0"], "train") == {
        "extra_fields": [info, {"reward_extra_info": {"acc": 0.0}}], "score": [2, None]}
    assert store.kv_batch_get(["u_2_0"], "train", select_fields="score") == {"score": [7]}
    store.kv_clear(["u_0_0"], "train")
    with pytest.raises(KeyError, match="u_0_0"):
        store.kv_batch_get(["u_0_0", "u_1_0"], "train")
    store.kv_put("u_0_0", "train", tag={"status": "running"})  # written again: its old fields are gone
    assert store.kv_batch_get(["u_0_0"], "train") == {}


def test_bad_fields_are_refused_and_nothing_is_written(store: SqliteSource) -> None:
    with pytest.raises(TypeError, match="not JSON-encodable"):
        store.kv_put("k", "train", fields={"t": object()}, tag={"status": "running"})
    with pytest.raises(ValueError, match="1 values for 2 keys"):
        store.kv_batch_put(["a", "b"], "train", fields={"x": [1]})
    with pytest.raises(TypeError, match="fields must be"):
        store.kv_put("k", "train", fields=[1, 2])
    assert store.kv_list() == {}


def test_list_one_partition(store: SqliteSource) -> None:
    store.kv_put("a", "train", tag={"n": 1})
    store.kv_put("b", "val", tag={"n": 2})
    assert store.kv_list("train") == {"train": {"a": {"n": 1}}}
    assert store.kv_list("val") == {"val": {"b": {"n": 2}}}
    assert store.kv_list("other") == {}


def test_empty_partitions_are_left_out(store: SqliteSource) -> None:
    store.kv_batch_put(["a", "b"], "train", tags=[{}, {}])
    store.kv_put("c", "val")
    store.kv_clear(["a", "b"], "train")
    assert store.kv_list() == {"val": {"c": {}}}
    assert store.kv_list("train") == {}


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda s: s.kv_put(1, "p", tag={}), TypeError, "key must be a str"),
        (lambda s: s.kv_put("k", None, tag={}), TypeError, "partition_id must be a str"),
        (lambda s: s.kv_put("k", "p", tag=["status"]), TypeError, "must be a dict"),
        (lambda s: s.kv_put("k", "p", tag={1: "x"}), TypeError, "dict key 1"),
        (lambda s: s.kv_put("k", "p", tag={"t": (1, 2)}), TypeError, "tuple"),
        (lambda s: s.kv_put("k", "p", tag={"t": object()}), TypeError, "not JSON-encodable"),
        (lambda s: s.kv_put("k", "p", tag={"t": {"deep": {2: 1}}}), TypeError, "dict key 2"),
        (lambda s: s.kv_put("k", "p", tag={"t": math.nan}), ValueError, "cannot be stored as JSON"),
        (lambda s: s.kv_batch_put("ab", "p"), TypeError, "keys must be a list"),
        (lambda s: s.kv_batch_put(["a", "b"], "p", tags={"a": {}}), TypeError, "tags must be a list"),
        # the first tag is fine, the second is not: nothing at all may be written
        (lambda s: s.kv_batch_put(["a", "b"], "p", tags=[{"ok": 1}, {"bad": {1, 2}}]), TypeError, "set"),
        (lambda s: s.kv_clear("a", "p"), TypeError, "keys must be a list"),
        (lambda s: s.kv_clear(["a", 2], "p"), TypeError, "keys\\[1\\]"),
        (lambda s: s.kv_list(3), TypeError, "partition_id must be a str"),
    ],
)
def test_bad_input_raises_and_writes_nothing(store: SqliteSource, call: Any, error: type[Exception],
                                             match: str) -> None:
    store.kv_put("a", "p", tag={"keep": 1})
    before = store.kv_list()
    with pytest.raises(error, match=match):
        call(store)
    assert store.kv_list() == before


# Rows another tool wrote: (partition id, key, tags) as SQL, and what every read lists for them.
_FOREIGN_ROWS = [
    ("'a'", "'k25x'", "'not json'", "a", "k25x",
     UnreadableValue("stored tags are not JSON: Expecting value: line 1 column 1 (char 0)")),
    ("'a'", "CAST(X'6b32ff' AS TEXT)", "'{}'", "a", b"k2\xff", {}),  # TEXT that is not UTF-8, sorted among a's keys
    ("'a'", "X'6b33'", "'{\"blob\": 1}'", "a", b"k3", {"blob": 1}),  # a BLOB key
    ("'b'", "'json-blob'", "CAST('{\"v\": 1}' AS BLOB)", "b", "json-blob", {"v": 1}),  # JSON in a BLOB: read
    ("'b'", "'list'", "'[1]'", "b", "list", UnreadableValue("stored tags are list, not an object")),
    ("'b'", "'bad-utf8'", "CAST(X'7bff7d' AS TEXT)", "b", "bad-utf8",
     UnreadableValue("stored tags are not UTF-8 text ('utf-8' codec can't decode byte 0xff in position 1: "
                     "invalid start byte)")),
    ("CAST(X'70ff' AS TEXT)", "'k'", "'{}'", b"p\xff", "k", {}),
]


def test_rows_another_tool_wrote_are_listed_by_every_read_instead_of_failing_it(store: SqliteSource,
                                                                                db: Path) -> None:
    # Before: kv_list() and the change feed raised ValueError (tags) or sqlite3.OperationalError (TEXT
    # that is not UTF-8, at fetch), so one such row failed every listing of every partition.
    store.kv_batch_put([f"k{i}" for i in range(50)], "a", tags=[{"i": i} for i in range(50)])
    cursor, _ = store.kv_snapshot()
    with sqlite3.connect(db) as conn:
        for partition, key, tags, *_ in _FOREIGN_ROWS:
            conn.execute(f"INSERT INTO kv (partition_id, key, tags) VALUES ({partition}, {key}, {tags})")
    conn.close()
    foreign: dict[Any, dict[Any, Any]] = {}
    for *_, partition, key, tags in _FOREIGN_ROWS:
        foreign.setdefault(partition, {})[key] = tags
    expected = {**foreign, "a": {**{f"k{i}": {"i": i} for i in range(50)}, **foreign["a"]}}
    assert store.kv_list() == expected
    assert store.kv_list("b") == {"b": foreign["b"]}
    assert store.kv_snapshot()[1] == expected
    _, pieces = store.kv_snapshot_pieces(7)  # the first row that is not UTF-8 comes in the middle of a piece
    merged: dict[Any, dict[Any, Any]] = {}
    rows = 0
    for piece in pieces:
        rows += sum(map(len, piece.values()))
        for partition, items in piece.items():
            merged.setdefault(partition, {}).update(items)
    assert merged == expected and rows == 50 + len(_FOREIGN_ROWS)
    changes = store.kv_changes(cursor)
    assert changes is not None and changes[1] == foreign and changes[2] == {}
    with sqlite3.connect(db) as conn:
        for partition, key, _, listed_as, *_ in _FOREIGN_ROWS:
            if listed_as != "b":
                conn.execute(f"DELETE FROM kv WHERE partition_id = {partition} AND key = {key}")
    conn.close()
    changes = store.kv_changes(changes[0])
    assert changes is not None and changes[1] == {}
    assert {p: sorted(map(repr, keys)) for p, keys in changes[2].items()} == {
        "a": ["'k25x'", "b'k2\\xff'", "b'k3'"], b"p\xff": ["'k'"]}
    # A write cannot merge into tags it cannot read: it says so and writes nothing.
    with pytest.raises(ValueError, match="stored tags of 'b'/'list' are list, not an object"):
        store.kv_batch_put(["fine", "list"], "b", tags=[{}, {}])
    assert "fine" not in store.kv_list("b")["b"]


def test_tags_nested_past_the_json_decoder_are_unreadable_in_every_read_and_refused_by_writes(store: SqliteSource,
                                                                                            db: Path) -> None:
    # Before: JSON nested past the decoder's limit made the decoder raise RecursionError (no ValueError), which every read
    # let through: kv_list() and both snapshots raised, and a poller failed every poll until PollerCrashed.
    deep = '{"deep": ' + "[" * 100_000 + "]" * 100_000 + "}"  # past the decoder's limit in every Python
    store.kv_put("fine", "p", tag={"v": 1})
    cursor, _ = store.kv_snapshot()
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO kv (partition_id, key, tags) VALUES ('p', 'deep', ?)", (deep,))
        conn.execute("INSERT INTO kv_fields (partition_id, key, fields) VALUES ('p', 'fine', ?)", (deep,))
    conn.close()
    unreadable = store.kv_list()["p"]["deep"]
    assert isinstance(unreadable, UnreadableValue) and "nest deeper than JSON can be read" in unreadable.reason
    expected = {"p": {"fine": {"v": 1}, "deep": unreadable}}
    assert store.kv_list() == store.kv_list("p") == store.kv_snapshot()[1] == expected
    _, pieces = store.kv_snapshot_pieces(1)
    merged: dict[Any, dict[Any, Any]] = {}
    for piece in pieces:
        for partition, items in piece.items():
            merged.setdefault(partition, {}).update(items)
    assert merged == expected
    changes = store.kv_changes(cursor)
    assert changes is not None and changes[1] == {"p": {"deep": unreadable}}
    # A read or a merge of such a row says which and why, and writes nothing.
    for call in (lambda: store.kv_batch_get(["deep"], "p"), lambda: store.kv_put("deep", "p", tag={"v": 2}),
                 lambda: store.kv_batch_get(["fine"], "p"), lambda: store.kv_put("fine", "p", fields={"f": 1})):
        with pytest.raises(ValueError, match=r"stored tags of 'p'/'(deep|fine)' nest deeper than JSON can be read"):
            call()
    # Tags too deep to store are refused as clearly.
    with pytest.raises(ValueError, match="tags of key 'k' nest too deep to be stored as JSON"):
        store.kv_put("k", "p", tag={"deep": nested_past_any_limit("dict", 5000)})
    assert store.kv_list() == expected


def test_reopen_after_close(db: Path) -> None:
    first = SqliteSource(db)
    first.kv_put("a", "p", tag={"global_steps": 1})
    first.close()
    first.close()  # idempotent
    # The same instance opens a new connection when used again ...
    first.kv_put("a", "p", tag={"status": "success"})
    first.close()
    # ... and a new instance sees everything that was committed.
    with SqliteSource(db) as second:
        assert second.kv_list() == {"p": {"a": {"global_steps": 1, "status": "success"}}}


def test_two_instances_see_each_others_writes(db: Path) -> None:
    with SqliteSource(db) as a, SqliteSource(db) as b:
        a.kv_put("k", "p", tag={"global_steps": 2, "status": "running"})
        b.kv_put("k", "p", tag={"status": "success"})
        assert a.kv_list() == b.kv_list() == {"p": {"k": {"global_steps": 2, "status": "success"}}}


def test_built_from_the_poller_spec(db: Path) -> None:
    source = load_source("poller.sources.sqlite:SqliteSource", {"path": str(db)})
    try:
        assert isinstance(source, SqliteSource)
        assert source.kv_list() == {}
    finally:
        source.close()  # type: ignore[attr-defined]


# -- several processes at once -------------------------------------------------

N_PROCS = 3
N_KEYS = 60
ROUNDS = 5


def _concurrent_writer(path: str, index: int) -> None:
    """Child: every process merges its own tag into the same shared keys.

    Each round re-puts every key with ``{f"w{index}": round}``; a lost update
    between processes would leave some ``w{n}`` at an older round (or missing).
    Each process also writes keys of its own, one at a time and in batches.
    """
    keys = [f"shared-{i}" for i in range(N_KEYS)]
    with SqliteSource(path, timeout=30.0) as source:
        for round_ in range(1, ROUNDS + 1):
            source.kv_batch_put(keys, "train", tags=[{f"w{index}": round_} for _ in keys])
            for i in range(0, N_KEYS, 7):
                source.kv_put(keys[i], "train", tag={f"single{index}": round_})
            own = [f"own-{index}-{round_}-{i}" for i in range(N_KEYS)]
            source.kv_batch_put(own, "train", tags=[{"global_steps": round_, "status": "running"} for _ in own])
            source.kv_batch_put(own, "train", tags=[{"status": "success"} for _ in own])
            source.kv_list()


def _reap(procs: list[Any]) -> None:
    """Kill what is still running and release every Process's sentinel fd."""
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(JOIN_TIMEOUT)
        if proc.exitcode is not None:
            proc.close()


def _run_all(procs: list[Any], started: Callable[[], None] = lambda: None) -> list[int | None]:
    """Start every process, call ``started()``, join each with a deadline; always reap."""
    try:
        for proc in procs:
            proc.start()
        started()
        for proc in procs:
            proc.join(JOIN_TIMEOUT)
        return [proc.exitcode for proc in procs]
    finally:
        _reap(procs)


def _fresh_file_writer(path: str, index: int, gate: Any) -> None:
    """Child: wait for the gate, then be one of several first openers of a new file."""
    if not gate.wait(JOIN_TIMEOUT):
        raise SystemExit(3)
    with SqliteSource(path) as source:
        source.kv_put(f"k{index}", "p", tag={"index": index})


def test_processes_opening_a_new_file_at_once(db: Path) -> None:
    # Regression: switching a new file to WAL raised "database is locked"
    # at once in some of the simultaneous openers.
    ctx = multiprocessing.get_context("spawn")
    gate = ctx.Event()
    procs = [ctx.Process(target=_fresh_file_writer, args=(str(db), n, gate)) for n in range(N_PROCS)]
    assert _run_all(procs, gate.set) == [0] * N_PROCS
    with SqliteSource(db) as store:
        assert store.kv_list() == {"p": {f"k{n}": {"index": n} for n in range(N_PROCS)}}


def test_concurrent_writers_from_three_processes(db: Path) -> None:
    with SqliteSource(db) as store:
        # Seed a row every writer must merge into rather than replace.
        store.kv_batch_put([f"shared-{i}" for i in range(N_KEYS)], "train",
                           tags=[{"global_steps": 9} for _ in range(N_KEYS)])
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_concurrent_writer, args=(str(db), n), name=f"sqlite-writer-{n}")
                 for n in range(N_PROCS)]
        assert _run_all(procs) == [0] * N_PROCS

        listing = store.kv_list()
        rows = listing["train"]
        assert len(rows) == N_KEYS + N_PROCS * ROUNDS * N_KEYS
        for i in range(N_KEYS):
            expected: dict[str, Any] = {"global_steps": 9}
            expected.update({f"w{n}": ROUNDS for n in range(N_PROCS)})
            if i % 7 == 0:
                expected.update({f"single{n}": ROUNDS for n in range(N_PROCS)})
            assert rows[f"shared-{i}"] == expected
        for n in range(N_PROCS):
            for round_ in range(1, ROUNDS + 1):
                for i in range(N_KEYS):
                    assert rows[f"own-{n}-{round_}-{i}"] == {"global_steps": round_, "status": "success"}


def test_use_from_another_thread(store: SqliteSource) -> None:
    """kv_list() is called from the poller's helper thread."""
    results: list[dict[str, Any]] = []
    store.kv_put("a", "p", tag={"n": 1})
    thread = threading.Thread(target=lambda: results.append(store.kv_list()))
    thread.start()
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive()
    assert results == [{"p": {"a": {"n": 1}}}]


def _forked_child(store: SqliteSource) -> None:
    """Child (fork): use the instance inherited with the parent's open connection."""
    store.kv_put("a", "p", tag={"status": "success"})
    store.close()


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_reopens_after_fork(store: SqliteSource) -> None:
    store.kv_put("a", "p", tag={"global_steps": 4})  # the parent's connection is open now
    proc = multiprocessing.get_context("fork").Process(target=_forked_child, args=(store,))
    try:
        proc.start()
        proc.join(JOIN_TIMEOUT)
        exitcode = proc.exitcode
    finally:
        _reap([proc])
    assert exitcode == 0
    # The parent's connection survived the child's use and close.
    assert store.kv_list() == {"p": {"a": {"global_steps": 4, "status": "success"}}}
