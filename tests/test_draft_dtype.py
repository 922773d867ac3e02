"""Drafts in another dtype than their target (`model:X@bf16`, `layers:0-1@bf16`): lossless, and the target untouched."""

from __future__ import annotations

import pytest
import torch

from draftlab.api import SpeculativeDecoder
from draftlab.errors import DraftlabError
from draftlab.models import eos_ids, load_model
from draftlab.drafters.model_spec import gguf_draft
from draftlab.registry import build_drafter, parse_drafter_spec
from draftlab.decoding.sampling import SamplingConfig
from tests.conftest import tiny_model_dir

PROMPT = " ".join(f"w{(3 * i) % 50}" for i in range(10))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtype")
    target = load_model(str(tiny_model_dir(root / "target")), dtype="fp32")
    return target, tiny_model_dir(root / "draft", layers=2, seed=1)


def test_spec_suffix_names_the_draft_dtype():
    assert parse_drafter_spec("model:qwen2.5-coder-0.5b@bf16").dtype == "bf16"
    assert parse_drafter_spec("model:a@b/dir").dtype == "" and parse_drafter_spec("model:a@b/dir").model == "a@b/dir"
    assert parse_drafter_spec("layers:0-3@bfloat16", 30).layers == (0, 1, 2, 3)
    assert parse_drafter_spec("tree:2x2:layers:0-1@fp16", 4).inner.dtype == "fp16"
    with pytest.raises(DraftlabError, match="unknown draft dtype 'int8'"):
        parse_drafter_spec("model:x@int8")


def test_a_gguf_draft_by_short_name_drafts_from_its_pure_q4_0_file_and_a_named_type_as_given():
    """A GGUF's weight type in capitals names the file (`model:NAME@Q4_K_M`); lower case is a torch dtype."""
    assert parse_drafter_spec("model:qwen2.5-coder-0.5b@Q4_K_M").model == "qwen2.5-coder-0.5b@Q4_K_M"
    assert parse_drafter_spec("model:qwen2.5-coder-0.5b@BF16").dtype == ""
    assert gguf_draft("qwen2.5-coder-0.5b") == "qwen2.5-coder-0.5b@Q4_0_PURE"
    assert gguf_draft("qwen2.5-coder-0.5b@Q8_0") == "qwen2.5-coder-0.5b@Q8_0"
    assert gguf_draft("drafts/mine.Q4_K_M.gguf") == "drafts/mine.Q4_K_M.gguf"
    assert parse_drafter_spec("model:qwen2.5-coder-0.5b@bf16,window=64").window == 64
    with pytest.raises(DraftlabError, match="bad draft window"):
        parse_drafter_spec("model:x,window=0")
    for spec in ("model:x@bf16,head=512,window=8", "model:x@bf16,window=8,head=512"):  # either order
        plan = parse_drafter_spec(spec)
        assert (plan.model, plan.dtype, plan.head, plan.window) == ("x", "bf16", 512, 8)
    for spec in ("model:x,head=0", "model:x,head=2,head=3", "model:x,head=a"):
        with pytest.raises(DraftlabError, match="bad draft head"):
            parse_drafter_spec(spec)


@pytest.mark.parametrize("k", [1, 3])
def test_a_draft_that_reads_the_prompts_last_tokens_only_stays_lossless_and_prefills_less(pair, k):
    target, draft_dir = pair
    expected = SpeculativeDecoder.from_names(target, drafter="none", k=1).generate(PROMPT, max_new_tokens=24).token_ids
    decoder = SpeculativeDecoder.from_names(target, drafter=f"model:{draft_dir},window=3", k=k)
    result = decoder.generate(PROMPT, max_new_tokens=24)
    assert result.token_ids == expected and result.stats.drafted > 0
    cached = decoder.drafter.backend.cache_len  # the window and what was drafted since, never the whole prompt
    assert cached <= 3 + len(expected) + k and decoder.drafter.name.endswith(",window=3")


@pytest.mark.parametrize("spec", ["model:{draft}@bf16", "layers:0-1@bf16", "tree:2x2:layers:0-1@bf16",
                                  "staged:ngram/model:{draft}@bf16"])
def test_bf16_draft_beside_fp32_target_equals_autoregressive(pair, spec):
    target, draft_dir = pair
    spec = spec.format(draft=draft_dir)
    expected = SpeculativeDecoder.from_names(target, drafter="none", k=1).generate(PROMPT, max_new_tokens=24).token_ids
    for k in (1, 3):
        decoder = SpeculativeDecoder.from_names(target, drafter=spec, k=k)
        assert decoder.generate(PROMPT, max_new_tokens=24).token_ids == expected
    assert "@bf16" in decoder.drafter.name


def test_bf16_draft_converts_copies_and_leaves_the_target_in_fp32(pair):
    target, _ = pair
    before = {name: tensor.clone() for name, tensor in target.model.state_dict().items()}
    built = build_drafter("layers:0-1@bf16", target)
    assert built.model.dtype == torch.bfloat16 and built.model.name.endswith("@bf16")
    assert all(p.dtype == torch.bfloat16 for p in built.model.model.parameters())
    assert all(p.dtype == torch.float32 for p in target.model.parameters())
    assert all(torch.equal(before[name], tensor) for name, tensor in target.model.state_dict().items())
    same = build_drafter("layers:0-1@fp32", target)
    assert same.model.name == build_drafter("layers:0-1", target).model.name  # the target's dtype: no suffix
    shared = same.model.model.model.layers[0].self_attn.q_proj.weight
    assert shared.data_ptr() == target.model.model.layers[0].self_attn.q_proj.weight.data_ptr()


def test_bf16_draft_proposes_a_distribution_over_the_whole_vocabulary(pair):
    target, draft_dir = pair
    drafter = build_drafter(f"model:{draft_dir}@bf16", target).drafter
    context = target.tokenizer(PROMPT)["input_ids"]
    drafter.begin(context)
    proposal = drafter.propose(context, 3, SamplingConfig(1.0), torch.Generator().manual_seed(0))
    assert proposal.draft_probs.dtype == torch.float32 and proposal.draft_probs.shape == (3, 64)
    torch.testing.assert_close(proposal.draft_probs.sum(-1), torch.ones(3))


def test_upcast_products_run_short_blocks_in_bf16_and_long_ones_in_fp32(monkeypatch):
    from draftlab.backends import numerics

    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=generator).bfloat16()  # [out, D]
    bias = torch.randn(40, generator=generator).bfloat16()
    product = numerics.UpcastLinear()
    short = torch.randn(numerics.UPCAST_MIN_ROWS - 1, 24, generator=generator).bfloat16()
    assert torch.equal(product(short, weight, bias), torch.nn.functional.linear(short, weight, bias))
    monkeypatch.setattr(numerics, "UPCAST_CHUNK", 24 * 7)  # 7 weight rows at a time: 6 chunks, the last short
    long = torch.randn(9, 24, generator=generator).bfloat16()
    out = product(long, weight, bias)  # [9, 40]
    exact = long.float() @ weight.float().T + bias.float()
    assert out.dtype == torch.bfloat16 and out.shape == (9, 40)
    torch.testing.assert_close(out.float(), exact, rtol=1e-2, atol=1e-2)
    assert product._scratch.numel() == 24 * 7  # one reused buffer of one chunk
    torch.testing.assert_close(product(long, weight).float(), long.float() @ weight.float().T, rtol=1e-2, atol=1e-2)


def test_a_bf16_draft_uses_upcast_products_on_cpus_without_native_bf16(pair):
    from draftlab.backends import FastLlamaBackend, make_backend
    from draftlab.backends.routes import upcast_pays

    target, _ = pair
    draft = build_drafter("layers:0-1@bf16", target).model
    backend = make_backend(draft.model, "cpu", "fast", batch_invariant=False)
    assert backend.upcast == upcast_pays(draft.model.config, "bf16")  # timed on this host
    assert make_backend(draft.model, "cpu", "fast").route.exact  # as a target: an exact route, measured
    assert not make_backend(target.model, "cpu", "fast").upcast  # fp32: no upcast
    # upcast or not, a bf16 draft scores a 12-token prefill to the same logits up to bf16 rounding
    forced = FastLlamaBackend(draft.model, batch_invariant=False, upcast=True)
    plain = FastLlamaBackend(draft.model, batch_invariant=False, upcast=False)
    tokens = [(7 * i) % 60 for i in range(12)]
    torch.testing.assert_close(forced.score(tokens), plain.score(tokens), rtol=0.05, atol=0.1)


def test_a_draft_head_of_the_lowest_token_ids_stays_lossless_on_torch(pair):
    """`model:NAME,head=N`: a cut draft of the N lowest ids (and the end-of-sequence ids), on the fast backend's
    cut head rows."""
    target, draft_dir = pair
    expected = SpeculativeDecoder.from_names(target, drafter="none", k=1).generate(PROMPT, max_new_tokens=24).token_ids
    decoder = SpeculativeDecoder.from_names(target, drafter=f"model:{draft_dir},head=40", k=3)
    result = decoder.generate(PROMPT, max_new_tokens=24)
    kept = decoder.drafter.vocab_map.tolist()
    assert result.token_ids == expected and result.stats.drafted > 0
    assert kept[:40] == list(range(40)) and set(kept[40:]) <= set(eos_ids(target))
    assert decoder.drafter.name.endswith(f"/v{len(kept)}")
    with pytest.raises(DraftlabError, match="larger than"):
        SpeculativeDecoder.from_names(target, drafter=f"model:{draft_dir},head={target.vocab_size + 1}", k=3)
