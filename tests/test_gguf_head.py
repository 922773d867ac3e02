"""Vocabulary-trimmed draft heads on llama.cpp: a cut draft runs from a GGUF whose head keeps only its rows, byte for
byte, whose logits are the whole head's at those rows, and which drafts losslessly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from draftlab.api import SpeculativeDecoder
from draftlab.backends.gguf import HEAD_ROWS_KEY, loads_trimmed_heads
from draftlab.backends.gguf_head import PAD_ROWS, derive_trimmed_head
from draftlab.backends.llamacpp import LlamaCppBackend
from draftlab.drafters.cut import CutDraft, save_cut_draft
from draftlab.drafters.model_spec import gguf_draft
from draftlab.errors import DraftlabError
from draftlab.files import assets
from draftlab.models import gguf_path, load_model
from tests.tiers import slow

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
ROWS = torch.tensor([0, 1, 2, 7, *range(100, 5000), 49151])  # token ids, ascending; not a multiple of 8 rows


def tensors(path):
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return reader, {t.name: t for t in reader.tensors}


@pytest.fixture(scope="module")
def trimmed():
    """The SmolLM2 draft's GGUF with a head of ROWS, derived into draftlab's cache (as the registry derives it)."""
    return derive_trimmed_head(gguf_path(gguf_draft("smollm2-135m")), ROWS, assets.cache_dir())


@pytest.mark.slow  # reads two GGUFs' tokenizers in Python (~13 s); the logits test below proves the same rows bitwise
def test_a_trimmed_head_holds_the_kept_rows_byte_for_byte_and_every_other_tensor_as_it_is(trimmed):
    source = gguf_path(gguf_draft("smollm2-135m"))
    reader, kept = tensors(trimmed)
    _, original = tensors(source)
    head = original.get("output.weight") or original["token_embd.weight"]
    assert int(reader.fields[HEAD_ROWS_KEY].contents()) == len(ROWS)
    rows = kept["output.weight"].data  # [V' rounded up to PAD_ROWS, ...]: the kept rows, then zero rows
    assert kept["output.weight"].tensor_type == head.tensor_type and len(rows) == 4928 and len(rows) % PAD_ROWS == 0
    assert rows[:len(ROWS)].tobytes() == np.ascontiguousarray(head.data[ROWS.numpy()]).tobytes()
    assert not rows[len(ROWS):].any()
    assert set(original) - {"output.weight"} == set(kept) - {"output.weight"}
    assert all(kept[n].data.tobytes() == original[n].data.tobytes() for n in original if n != "output.weight")
    stamp = trimmed.stat().st_mtime_ns
    assert derive_trimmed_head(source, ROWS, assets.cache_dir()) == trimmed and trimmed.stat().st_mtime_ns == stamp


@pytest.mark.parametrize("rows", [[], [3, 2], [1, 1], [-1, 4], slow([0, 49152])])  # the last one reads the file
def test_token_ids_out_of_order_repeated_or_beyond_the_vocabulary_are_refused(tmp_path, rows):
    with pytest.raises(DraftlabError, match="distinct ascending token ids"):
        derive_trimmed_head(gguf_path(gguf_draft("smollm2-135m")), torch.tensor(rows, dtype=torch.int64), tmp_path)
    assert not list(tmp_path.rglob("*.gguf")) and not list(tmp_path.rglob("*.partial"))  # nothing half-written


def test_a_trimmed_head_scores_the_whole_heads_logits_at_its_rows_and_minus_infinity_after_them(trimmed):
    assert loads_trimmed_heads()  # draftlab's build of llama.cpp (scripts/llama-cpp/trimmed-head.patch)
    source = gguf_draft("smollm2-135m")
    whole = load_model(source, backend="llamacpp", repack=True)
    trimmed = load_model(str(trimmed), backend="llamacpp", repack=True)
    assert trimmed.model.head_rows == len(ROWS) and whole.model.head_rows == 0
    tokens = whole.tokenizer(PROMPT)["input_ids"]
    expected = LlamaCppBackend(whole.model).score(tokens)  # [n, V]
    backend = LlamaCppBackend(trimmed.model, head_rows=ROWS)
    logits = backend.score(tokens)  # [n, V']
    assert logits.shape == (len(tokens), len(ROWS))
    assert torch.equal(logits, expected[:, ROWS])  # each output's products as in the whole head
    sequences = backend.sequences
    raw = np.ctypeslib.as_array(sequences.lib.llama_get_logits(sequences._ctx), shape=(len(tokens), whole.vocab_size))
    assert np.all(raw[:, len(ROWS):4928] == 0) and np.all(raw[:, 4928:] == -np.inf)  # padding rows, then no rows
    with pytest.raises(DraftlabError, match="drafts only as a cut draft"):
        LlamaCppBackend(trimmed.model)
    with pytest.raises(DraftlabError, match="holds all 49152 rows, not the 4905"):
        LlamaCppBackend(whole.model, head_rows=ROWS)


def test_a_cut_draft_on_llama_cpp_drafts_losslessly_from_its_trimmed_head(tmp_path, trimmed):
    target = load_model("smollm2-135m", backend="llamacpp")
    save_cut_draft(CutDraft("smollm2-135m", ROWS), tmp_path / "cut", target)
    expected = SpeculativeDecoder.from_names(target, drafter="none", k=1).generate(PROMPT, max_new_tokens=24)
    decoder = SpeculativeDecoder.from_names(target, drafter=f"model:{tmp_path / 'cut'}", k=3)
    result = decoder.generate(PROMPT, max_new_tokens=24)
    assert result.token_ids == expected.token_ids and result.stats.drafted > 0 and result.stats.accepted > 0
    assert decoder.drafter.name == f"{gguf_draft('smollm2-135m')}/v{len(ROWS)}"
    with pytest.raises(DraftlabError, match="drop @bf16"):
        SpeculativeDecoder.from_names(target, drafter=f"model:{tmp_path / 'cut'}@bf16", k=3)
