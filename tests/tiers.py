"""The test tiers, marked on the tests themselves.

- unmarked: the README's test command (unit tests on tiny random models, one real-model smoke test per engine);
- `slow`: the real-model, statistical, subprocess and server suites; CI runs them in its later stage;
- `slow` and `exhaustive`: the rest of a slow matrix (more K, temperatures, shapes, dtypes); `pytest -m slow` runs
  them, CI leaves them out (each differs from a kept case only in such a parameter).

A whole test takes `@pytest.mark.slow`; one case of a matrix takes `slow(...)` or `exhaustive(...)` below.
"""

from __future__ import annotations

import itertools

import pytest

EXHAUSTIVE = (pytest.mark.slow, pytest.mark.exhaustive)


def slow(*values, id: str | None = None):
    """One case of a parametrized test in the slow tier."""
    return pytest.param(*values, marks=pytest.mark.slow, id=id)


def exhaustive(*values, id: str | None = None):
    """One case of a parametrized test in the exhaustive remainder of the slow tier."""
    return pytest.param(*values, marks=EXHAUSTIVE, id=id)


def matrix(kept: set[tuple], *axes) -> list:
    """Every combination of `axes` (one value per axis, ids as pytest makes them): the `kept` ones in the slow tier,
    the others in its exhaustive remainder."""
    return [slow(*combo) if combo in kept else exhaustive(*combo) for combo in itertools.product(*axes)]
