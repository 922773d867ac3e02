"""Loading a model from a library call prints nothing unless asked."""

from __future__ import annotations

from draftlab.models import load_model
from tests.conftest import tiny_model_dir


def test_model_loads_are_quiet_unless_asked(tmp_path, capfd):
    from transformers.utils import logging as hf_logging

    directory = tiny_model_dir(tmp_path / "tiny")
    bars_before = hf_logging.is_progress_bar_enabled()
    hf_logging.enable_progress_bar()  # as in a fresh process (the CLI turns them off for its own output)
    try:
        capfd.readouterr()
        load_model(str(directory), dtype="fp32")
        quiet = capfd.readouterr()
        assert "Loading weights" not in quiet.err + quiet.out
        assert hf_logging.is_progress_bar_enabled()  # transformers' own setting is restored
        load_model(str(directory), dtype="fp32", verbose=True)
        loud = capfd.readouterr()
        assert "Loading weights" in loud.err + loud.out
    finally:
        (hf_logging.enable_progress_bar if bars_before else hf_logging.disable_progress_bar)()
