"""95% intervals for a ratio of medians measured in interleaved rounds.

Each round measures the case and its reference once, one right after the
other, so a change of the machine's load hits both; a round is the unit that
is resampled. The estimate is ``median(cases) / median(references)``; its
interval is a percentile bootstrap over rounds, each resample keeping a
round's two figures together (so what the load did to both stays paired),
with a fixed seed so that the same figures always print the same interval.
With few rounds a median takes few distinct values and the interval is
coarse (with 5 rounds it cannot be narrower than the spread of the middle
three); it is what one run can tell, printed beside the goal it decides.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Sequence

RESAMPLES = 10_000
SEED = 29


@dataclass(frozen=True)
class Estimate:
    """A ratio of medians with its 95% interval, from ``rounds`` paired rounds."""

    value: float
    low: float
    high: float
    rounds: int

    def text(self, digits: int = 3) -> str:
        return f"{self.value:.{digits}g} (95% interval {self.low:.{digits}g}–{self.high:.{digits}g}, " \
               f"{self.rounds} rounds)"


def ratio_of_medians(cases: Sequence[float], references: Sequence[float], resamples: int = RESAMPLES,
                     seed: int = SEED) -> Estimate:
    """``median(cases) / median(references)`` with a paired percentile-bootstrap 95% interval over rounds.

    ``cases[i]`` and ``references[i]`` are round ``i``'s two figures.
    Raises ``ValueError`` for unequal lengths, no rounds, or a reference
    median that is not positive.
    """
    if len(cases) != len(references):
        raise ValueError(f"{len(cases)} cases against {len(references)} references: rounds must pair")
    if not cases:
        raise ValueError("no rounds")
    value = _ratio(cases, references)
    rng = random.Random(seed)
    n = len(cases)
    ratios = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        ratios.append(_ratio([cases[i] for i in picks], [references[i] for i in picks]))
    ratios.sort()
    return Estimate(value, _quantile(ratios, 0.025), _quantile(ratios, 0.975), n)


def median_of(values: Sequence[float], resamples: int = RESAMPLES, seed: int = SEED) -> Estimate:
    """The median of per-round figures with the same bootstrap interval (a ratio to a reference of 1)."""
    return ratio_of_medians(values, [1.0] * len(values), resamples, seed)


def _ratio(cases: Sequence[float], references: Sequence[float]) -> float:
    reference = statistics.median(references)
    if reference <= 0:
        raise ValueError(f"the reference's median is {reference}: a ratio needs a positive one")
    return statistics.median(cases) / reference


def _quantile(ordered: Sequence[float], q: float) -> float:
    """The ``q`` quantile of sorted ``ordered``, interpolated between neighbours."""
    position = q * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)
