"""Layer self-drafts on llama.cpp: the target's chosen layers written as a GGUF of their own, byte for byte, and
drafting losslessly from its own context."""

from __future__ import annotations

import pytest

from tests.tiers import slow

from draftlab.api import SpeculativeDecoder
from draftlab.backends.gguf_layers import derive_layer_draft, layers_label
from draftlab.errors import DraftlabError
from draftlab.models import gguf_path, load_model

PROMPT = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"


def tensors(path):
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return reader, {t.name: t for t in reader.tensors}


@pytest.mark.slow
def test_a_layer_draft_holds_the_kept_layers_renumbered_byte_for_byte(tmp_path):
    source = gguf_path("smollm2-135m")
    out = derive_layer_draft(source, (0, 2, 5), tmp_path)
    assert out.name.endswith(".layers-0.2.5.gguf") and layers_label((3, 4, 5)) == "3-5"
    reader, drafted = tensors(out)
    _, original = tensors(source)
    assert int(reader.fields["llama.block_count"].contents()) == 3
    assert {name.split(".")[1] for name in drafted if name.startswith("blk.")} == {"0", "1", "2"}
    for new, old in ((0, 0), (1, 2), (2, 5)):
        for name in (n for n in original if n.startswith(f"blk.{old}.")):
            moved = drafted[name.replace(f"blk.{old}.", f"blk.{new}.", 1)]
            assert moved.tensor_type == original[name].tensor_type
            assert moved.data.tobytes() == original[name].data.tobytes()
    rest = {n for n in original if not n.startswith("blk.")}
    assert rest <= set(drafted) and all(drafted[n].data.tobytes() == original[n].data.tobytes() for n in rest)
    assert len(drafted) == len(rest) + 3 * sum(n.startswith("blk.0.") for n in original)
    stamp = out.stat().st_mtime_ns
    assert derive_layer_draft(source, (0, 2, 5), tmp_path) == out and out.stat().st_mtime_ns == stamp  # cached


@pytest.mark.parametrize("layers", [(), slow((2, 1)), slow((1, 1)), slow((-1, 0))])  # each loads the model: one here
def test_a_layer_list_out_of_order_repeated_or_beyond_the_model_is_refused(tmp_path, layers):
    with pytest.raises(DraftlabError, match="distinct layers in ascending order"):
        derive_layer_draft(gguf_path("smollm2-135m"), layers, tmp_path)
    assert not list(tmp_path.rglob("*.gguf")) and not list(tmp_path.rglob("*.partial"))  # nothing half-written
    with pytest.raises(DraftlabError, match="within 0-29, got \\[0, 30\\]"):
        derive_layer_draft(gguf_path("smollm2-135m"), (0, 30), tmp_path)  # the model's 30 layers, read from it


# (spec, whether its drafts must agree with the target somewhere): the first 25 of SmolLM2's 30 layers drafted 36-37
# tokens here with 10-12 accepted on AVX-512 and AVX2 builds alike; 5 spread layers agree with the target by chance
# only (0 or 1 of 63-66 drafts, by the host's rounding), so that case checks the lossless output and the name
@pytest.mark.parametrize("spec, agrees", [slow("layers:0-24", True), slow("layers:0-29:6", False)])
def test_a_layer_draft_on_llama_cpp_drafts_losslessly_from_its_own_file(spec, agrees):
    target = load_model("smollm2-135m", backend="llamacpp")
    expected = SpeculativeDecoder.from_names(target, drafter="none", k=1).generate(PROMPT, max_new_tokens=24)
    decoder = SpeculativeDecoder.from_names(target, drafter=spec, k=3)
    result = decoder.generate(PROMPT, max_new_tokens=24)
    assert result.token_ids == expected.token_ids and result.stats.drafted > 0
    assert result.stats.accepted > 0 or not agrees
    assert decoder.drafter.name == spec.replace("0-29:6", "0.6.12.18.24")
    with pytest.raises(DraftlabError, match="drop @bf16"):
        SpeculativeDecoder.from_names(target, drafter="layers:0-3@bf16", k=3)
