"""Other weight types of the shipped GGUF, derived with llama.cpp's quantizer (`NAME@TYPE`), cached and checked."""

from __future__ import annotations

import pytest

from draftlab.api import SpeculativeDecoder, encode_prompt
from draftlab.files.assets import sha256_file
from draftlab.backends.quantize import weight_type_name
from draftlab.errors import DraftlabError
from draftlab.models import gguf_path, is_gguf, load_model, split_weight_type

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_a_derived_type_is_cached_checked_and_derived_again_when_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path))
    shipped = gguf_path("smollm2-135m")  # fetched into the temporary cache
    derived = gguf_path("smollm2-135m@q8_0")
    assert derived.name.endswith(".Q8_0.gguf") and derived.stat().st_size > shipped.stat().st_size
    checksum = derived.with_name(derived.name + ".sha256")
    assert checksum.read_text().strip() == sha256_file(derived)
    stamp = derived.stat().st_mtime_ns
    assert gguf_path("smollm2-135m@Q8_0") == derived and derived.stat().st_mtime_ns == stamp  # reused, not rewritten
    with open(derived, "r+b") as f:  # damaged in the cache: derived again, never loaded as it is
        f.seek(4096)
        f.write(b"\xff" * 64)
    assert gguf_path("smollm2-135m@Q8_0") == derived and checksum.read_text().strip() == sha256_file(derived)
    assert load_model("smollm2-135m@Q8_0", backend="llamacpp").precision == "Q8_0"


@pytest.mark.slow
def test_greedy_decoding_stays_lossless_on_a_derived_type():
    target = load_model("smollm2-135m@BF16", backend="llamacpp")
    assert target.precision == "BF16" and target.name == "smollm2-135m@BF16" and is_gguf("smollm2-135m@BF16")
    ids = encode_prompt(target.tokenizer, "Repeat exactly: the cat sat on the mat. the cat sat on the mat.")
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1).generate(ids, max_new_tokens=32)
    ngram = SpeculativeDecoder.from_names(target, drafter="ngram", k=3).generate(ids, max_new_tokens=32)
    assert ngram.token_ids == plain.token_ids and ngram.stats.steps < plain.stats.steps


@pytest.mark.slow
def test_weight_type_names_are_checked_in_one_line():
    assert split_weight_type("smollm2-135m@bf16") == ("smollm2-135m", "BF16")
    assert split_weight_type("dir/name@home.gguf") == ("dir/name@home.gguf", None)  # not a type: a path
    with pytest.raises(DraftlabError, match="unknown weight type 'Q9'; llama.cpp's quantizer writes F32"):
        weight_type_name("Q9")
    with pytest.raises(DraftlabError, match="@TYPE"):
        gguf_path("smollm2-135m@Q9")
