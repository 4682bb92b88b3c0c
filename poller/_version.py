"""The one version of both packages: setup.cfg reads it (``attr:``), ``poller`` and ``buffer`` export it."""

__version__ = "0.1.0"
