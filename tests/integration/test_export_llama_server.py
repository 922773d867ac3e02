"""The llama-server exports name only options the built server documents in its own --help, with values it lists."""

from __future__ import annotations

import re
import shlex
import subprocess

import pytest

from draftlab.deploy import Deployable, export
from draftlab.deploy import SPEC_TYPES

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def documented(binary) -> tuple[set[str], set[str]]:
    """(every option name, the --spec-type values) of the server's --help."""
    text = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60).stdout
    names = set(re.findall(r"(?:^|[ ,])(--?[a-z][a-z0-9-]*)", text, flags=re.MULTILINE))
    types = re.search(r"^--spec-type (\S+)", text, flags=re.MULTILINE)
    assert types, "llama-server --help lists no --spec-type values"
    return names, set(types.group(1).split(","))


@pytest.mark.slow
@pytest.mark.parametrize("draft, k", [("ngram", 3), ("ngram:2-4", 6), ("model:smollm2-135m", 4), ("ngram-mod", 32),
                                      ("ngram-simple", 16), ("draft-simple/smollm2-135m,p=0.5", 4), ("none", 0)])
def test_llama_server_exports_use_documented_options(documented, draft, k):
    names, types = documented
    assert set(SPEC_TYPES) <= types
    words = shlex.split(export(Deployable("smollm2-135m", draft, k), "llama-server"))
    options = [w for w in words[1:] if w.startswith("-")]
    assert options and set(options) <= names, set(options) - names
    if "--spec-type" in words:
        assert words[words.index("--spec-type") + 1] in types
    for flag in ("--spec-draft-n-max", "--spec-ngram-simple-size-n", "--spec-ngram-simple-size-m",
                 "--spec-ngram-mod-n-max", "--spec-ngram-mod-n-min"):
        if flag in words:
            assert int(words[words.index(flag) + 1]) >= 1
