"""Record a real TransferQueue controller's raw KV_LIST replies, one per case of tq_values.CASES.

Regenerates ``tests/data/tq_kv_list_replies.msgpack``, which the unit tests
(``tests/test_transferqueue_source.py``, run without TransferQueue) decode::

    make .venv/.installed-transferqueue
    .venv/bin/python -m tests.integration.capture_tq_replies [OUTPUT]

A store host (``store_host.py``: Ray + ``tq.init``) writes each case's record
and a plain one into partition ``"p"``; this process sends the controller a
KV_LIST request over a DEALER socket of its own and keeps the reply frames as
they arrived. The file is one msgpack map: the releases that produced it and
``{"cases": {case: [frame, ...]}, "all_at_once": [frame, ...]}`` (the last: every
case at once, each in partition ``"p-<case>"``).
"""

from __future__ import annotations

import logging
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Sequence

import msgpack
import zmq

from poller.sources.transferqueue import KV_LIST, encode_request
from tests.integration.store_host import StoreHost
from tests.integration.tq_values import CASES

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "data" / "tq_kv_list_replies.msgpack"
PARTITION = "p"


def raw_kv_list(address: str, timeout: float = 30.0) -> list[bytes]:
    """The controller's reply frames to ``KV_LIST(partition_id=None)``, undecoded."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send_multipart(encode_request(KV_LIST, {"partition_id": None}, sender_id="capture", receiver_id=None))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no KV_LIST reply from {address} within {timeout}s")
        frames = sock.recv_multipart()
        sock.close(0)
        return frames
    finally:
        ctx.term()


def main(argv: Sequence[str] | None = None) -> int:
    """Capture every case and write the data file; returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    output = Path(args[0]) if args else DEFAULT_OUTPUT
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    host = StoreHost()
    try:
        address = host.call("kwargs")["address"]
        cases: dict[str, list[bytes]] = {}
        host.call("clear_all")
        for case in CASES:
            host.call("run", "tests.integration.tq_values:put_case", case=case, partition=PARTITION)
            cases[case] = raw_kv_list(address)
            logger.info("%s: %d frame(s), %s bytes", case, len(cases[case]), [len(f) for f in cases[case]])
            host.call("run", "tests.integration.tq_values:clear_case", case=case, partition=PARTITION)
        # Every case at once, each in partition "p-<case>": the big ints make the controller pickle
        # this whole reply, so every other kind also shows up in its pickled form.
        for case in CASES:
            host.call("run", "tests.integration.tq_values:put_case", case=case, partition=f"{PARTITION}-{case}")
        all_at_once = raw_kv_list(address)
        logger.info("all at once: %d frame(s), %s bytes", len(all_at_once), [len(f) for f in all_at_once])
        for case in CASES:
            host.call("run", "tests.integration.tq_values:clear_case", case=case, partition=f"{PARTITION}-{case}")
    finally:
        host.stop()
    data = {"transferqueue": version("transferqueue"), "numpy": version("numpy"), "torch": version("torch"),
            "msgspec": version("msgspec"), "cases": cases, "all_at_once": all_at_once}
    output.write_bytes(msgpack.packb(data, use_bin_type=True))
    logger.info("wrote %s", output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
