"""How many tokens to draft at each step.

Drafters do not own K. The engine asks the policy before each step and tells it
what happened afterwards, which is all a dynamic policy needs.
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
