"""Parts a test needs that ./run.sh installs: a test skips without one, unless CI requires it (`DRAFTLAB_REQUIRE_*`
set: the test then fails, so a part missing from CI's setup is never a silent skip)."""

from __future__ import annotations

import importlib
import os

import pytest

OPENAI = "DRAFTLAB_REQUIRE_OPENAI"
ARCTIC = "DRAFTLAB_REQUIRE_ARCTIC"  # arctic-inference: suffix decoding
LLAMA_CPP = "DRAFTLAB_REQUIRE_LLAMA_CPP"  # llama-cpp-python


def module_or_skip(name: str, env: str, hint: str):
    """The module; a skip without it, a failure where `env` requires it."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get(env):
            pytest.fail(f"{env} is set and {name} does not import: {exc}")
        pytest.skip(hint)


def unless(available: bool, env: str, reason: str):
    """A mark that skips without the part, unless `env` requires it (then the tests run, and fail without it)."""
    return pytest.mark.skipif(not available and not os.environ.get(env), reason=reason)
