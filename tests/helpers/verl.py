"""What buffer.verl's calls return, as verl's own sampler returns it."""

from __future__ import annotations

from typing import Any

from buffer.verl.sampler import SAMPLER_METRICS


def verls(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` without the sampler's own figures (``sampler/``): the metrics verl's own sampler returns too."""
    return {name: value for name, value in metrics.items() if name not in SAMPLER_METRICS}
