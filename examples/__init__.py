"""Runnable examples (``python examples/NAME.py``); importable for the tests and benchmarks."""
