"""How much the plain baseline moved during a study, from its re-timings: the sweep paces by it (a noisy host widens
the race's margin), and the answer reports it beside every ratio."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from draftlab.perf.baselines import baseline_timings

NOISY_DRIFT = 0.10  # a baseline that moved more than this (relative) during the study makes it noisy


@dataclass(frozen=True)
class Drift:
    """How much the baseline moved during a study: the largest relative spread of one prompt's re-timings.

    The median over prompts beside it tells a machine that was noisy throughout (median close to the largest)
    from one disturbed once (a small median under one large spread); the NOISY flag follows the largest.
    """

    prompts: int  # prompts whose baseline was timed more than once
    spread: float  # max over prompts of (fastest - slowest) / median baseline tokens/s
    typical: float = 0.0  # the median over prompts of the same spread

    @property
    def noisy(self) -> bool:
        """True when the machine's speed moved enough to shift ratios measured against one baseline."""
        return self.spread > NOISY_DRIFT

    def describe(self) -> str:
        """One sentence for the terminal and the report."""
        if not self.prompts:
            return "baseline drift: not measured (no baseline re-checks in this study)"
        verdict = ("NOISY: the machine's speed moved during the study; each speedup is against the baseline "
                   "measured closest in time, but treat differences below the drift as noise"
                   if self.noisy else "quiet")
        return (f"baseline drift: {self.spread:.1%} over {self.prompts} prompt(s), median {self.typical:.1%} "
                f"({verdict})")


def baseline_drift(rows: list[dict], checks: list[dict]) -> Drift:
    """The study's drift from its baseline re-checks."""
    spreads = [
        (max(speeds) - min(speeds)) / statistics.median(speeds)
        for speeds in ([v for _, v in timings] for timings in baseline_timings(rows, checks).values())
        if len(speeds) > 1
    ]
    return Drift(len(spreads), max(spreads, default=0.0), statistics.median(spreads) if spreads else 0.0)
