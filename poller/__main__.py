"""``python -m poller``: see :mod:`poller.cli`."""

from poller.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
