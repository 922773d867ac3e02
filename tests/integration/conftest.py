"""Shared fixtures of the integration tests."""

from __future__ import annotations

import os

import pytest

from draftlab.errors import DraftlabError
from draftlab.contenders.llama_server import server_binary


@pytest.fixture(scope="session")
def binary():
    """The llama-server binary; the test skips without it, unless CI requires it (DRAFTLAB_REQUIRE_LLAMA_SERVER)."""
    try:
        return server_binary()
    except DraftlabError as exc:
        if os.environ.get("DRAFTLAB_REQUIRE_LLAMA_SERVER"):
            raise
        pytest.skip(str(exc))
