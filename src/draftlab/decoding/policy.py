"""How much to draft at each step: K, and the rules that stop drafting sooner.

Drafters do not own K. The engine asks the policy before each step and tells it
what happened afterwards, which is all a dynamic policy needs. A tree drafter
whose confidence stop adapts (`tree:SHAPE@auto:...`) exposes the stop as a knob
(`Drafter.confidence_stop`); the rule that moves it with acceptance is a policy
too (`AdaptiveConfidence`), which the engine wraps around the K policy.
"""

from __future__ import annotations

from typing import Protocol

from draftlab.defaults import DraftSettings
from draftlab.errors import DraftlabError


class DraftLengthPolicy(Protocol):
    """Decides K for the next step from what happened in earlier steps."""

    def begin(self) -> None:
        """A new generation starts."""
        ...

    def next_k(self) -> int:
        """Number of tokens to draft in the next step (>= 1)."""
        ...

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Outcome of the step just verified: the depth drafted (a chain's length, a tree's levels), tokens accepted."""
        ...


class FixedK:
    """Always draft K tokens."""

    def __init__(self, k: int) -> None:
        self.k = DraftSettings(k=k).k  # validated there, once

    def begin(self) -> None:
        """Nothing to reset."""

    def next_k(self) -> int:
        """The fixed K."""
        return self.k

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Fixed K ignores outcomes."""


class DynamicK:
    """HF's heuristic: K grows by 2 after a fully accepted draft, shrinks by 1 otherwise."""

    def __init__(self, k: int, k_min: int = 1, k_max: int = 16) -> None:
        if not 1 <= k_min <= k <= k_max:
            raise DraftlabError(f"dynamic K needs 1 <= k_min <= k <= k_max, got {k_min}, {k}, {k_max}")
        self.initial, self.k_min, self.k_max = k, k_min, k_max
        self.k = k

    def begin(self) -> None:
        """Start again from the initial K."""
        self.k = self.initial

    def next_k(self) -> int:
        """The current K."""
        return self.k

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Grow on full acceptance, shrink on rejection."""
        if num_drafted == 0:
            return
        step = 2 if num_accepted == num_drafted else -1
        self.k = max(self.k_min, min(self.k_max, self.k + step))


class ConfidenceStop:
    """The draft probability below which a tree drafter stops expanding nodes: a knob the drafter reads before each
    proposal and `AdaptiveConfidence` moves."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.value = start


class AdaptiveConfidence:
    """A K policy's decisions, and a confidence stop that moves with acceptance: lower after a step whose deepest
    drafted path the target accepted whole (draft further), higher after a rejection (stop sooner). A step's stop
    depends only on earlier steps' outcomes, so verification stays lossless."""

    START, DOWN, UP, LOW, HIGH = 0.3, 0.7, 1.25, 0.01, 0.9

    def __init__(self, inner: DraftLengthPolicy, stop: ConfidenceStop) -> None:
        self.inner, self.stop = inner, stop

    def begin(self) -> None:
        """A new generation: the inner policy's start, and the stop's."""
        self.inner.begin()
        self.stop.value = self.stop.start

    def next_k(self) -> int:
        """The inner policy's K."""
        return self.inner.next_k()

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """Move the stop by the step's outcome (nothing drafted: no move); tell the inner policy."""
        self.inner.observe(num_drafted, num_accepted)
        if num_drafted == 0:
            return
        factor = self.DOWN if num_accepted >= num_drafted else self.UP
        self.stop.value = min(self.HIGH, max(self.LOW, self.stop.value * factor))


def with_confidence_stop(policy: DraftLengthPolicy, stop: ConfidenceStop | None) -> DraftLengthPolicy:
    """The policy, wrapped to move the drafter's adaptive confidence stop when it has one."""
    return policy if stop is None else AdaptiveConfidence(policy, stop)
