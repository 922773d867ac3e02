"""The designed draft shipped for the embedded target: pinned by SHA256, refused when modified."""

from __future__ import annotations

import json
import shutil

import pytest

from draftlab.drafters.files import RECORD, WEIGHTS
from draftlab.drafters.shipped import SHIPPED, check_files, shipped_draft
from draftlab.errors import DraftlabError
from draftlab.registry import parse_drafter_spec


def test_the_shipped_draft_matches_its_pinned_hashes():
    directory = shipped_draft("smollm2-135m")
    record = json.loads((directory / RECORD).read_text())
    assert record["format"] == "draftlab-feature-draft" and record["target"] == "smollm2-135m"
    assert (directory / WEIGHTS).stat().st_size < 10 * 2**20  # one asset up to 10 MB may live in git
    assert record["made"]["train"]["history"][-1]["held_out_agreement"] > 0.2


def test_a_modified_file_is_refused(tmp_path):
    copy = tmp_path / "draft"
    shutil.copytree(shipped_draft("smollm2-135m"), copy)
    manifest = SHIPPED["designed"]["smollm2-135m"][1]
    check_files(copy, manifest)  # an exact copy passes
    data = bytearray((copy / WEIGHTS).read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the middle of the weights
    (copy / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(DraftlabError, match="modified or damaged"):
        check_files(copy, manifest)
    (copy / WEIGHTS).unlink()
    with pytest.raises(DraftlabError, match="missing"):
        check_files(copy, manifest)


def test_designed_needs_a_target_with_a_shipped_draft():
    assert parse_drafter_spec("designed").kind == "designed"
    with pytest.raises(DraftlabError, match="no designed draft ships for target 'gemma3-270m'"):
        shipped_draft("gemma3-270m")
    with pytest.raises(DraftlabError, match="unknown drafter"):
        parse_drafter_spec("designed:x")
