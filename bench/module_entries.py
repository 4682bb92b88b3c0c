"""How often each product module is entered while one changed key travels from a SQLite store to ``sample()``.

    python -m bench.module_entries [--out PATH]

The path of ``tests/test_data_path.py`` (a real poller process and a real buffer, both profiled, polling every
0.05 s), counted rather than listed: a module is *entered* when a function of it is called from another module.
The window holds the key's poll and its ``sample()``: the poller's control loop and the writer's thread are left
out; a heartbeat that falls in the window adds its own entries to the receiver's. 0: the module's code ran,
from a loop already running in it (the polling thread's, the receiver's).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Sequence

from tests.helpers.tracing import Entries, trace_one_changed_key

RESULTS = Path(__file__).resolve().parent / "results" / "module-entries.md"
# Threads whose work is the key's path: the poller's source thread, the buffer's receiver, the sampling call.
PATH_THREADS = {"poller-source": "poller: the polling thread", "replay-receiver": "trainer: the receiver",
                "MainThread": "trainer: the sample() call"}


def table(poller: Entries, trainer: Entries) -> list[str]:
    """One row per (thread, module) on the path, most entered first."""
    rows = ["| thread | module | entries |", "|---|---|---|"]
    for process, threads in (("poller", poller), ("trainer", trainer)):
        for thread, entries in threads.items():
            label = PATH_THREADS.get(thread)
            if label is None or not label.startswith(process):
                continue
            rows += [f"| {label} | `{module}` | {count} |" for module, count in Counter(entries).most_common()]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.module_entries", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS), help="where to write the markdown table")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        poller, trainer = trace_one_changed_key(Path(tmp))
    rows = table(poller, trainer)
    text = "\n".join(["# Module entries on one changed key's path", "",
                      "- command: `python -m bench.module_entries`",
                      "- " + __doc__.split("\n\n")[2].replace("\n", " ").strip(), "", *rows, ""])
    Path(args.out).write_text(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
