"""``python -m poller``: see :mod:`poller.cli`."""

import sys

from poller.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
