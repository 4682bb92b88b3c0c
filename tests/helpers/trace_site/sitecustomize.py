"""A poller child started with this directory on ``PYTHONPATH`` and ``REPLAY_TRACE_FILE`` set records which
product modules it runs (:func:`tests.helpers.tracing.record_process`)."""

import os
import sys

if os.environ.get("REPLAY_TRACE_FILE") and "poller.child" in sys.orig_argv:
    from tests.helpers.tracing import record_process

    record_process(os.environ["REPLAY_TRACE_FILE"])
