"""The llama.cpp backend on the real SmolLM2 GGUF (Q4_1, as shipped): exact block rows, trees, rollback, greedy
equality for every drafter that runs there, sampling, clear errors, and llama-cpp-python's own API as a peer."""

from __future__ import annotations

import pytest
import torch

from draftlab.api import SpeculativeDecoder, encode_prompt, eos_ids
from draftlab.backends.llamacpp import LlamaCppBackend
from draftlab.backends.llamacpp_trees import dfs_order, inverse, leaves_below
from draftlab.errors import DraftlabError
from draftlab.models import gguf_path, load_model
from draftlab.decoding.sampling import SamplingConfig
from draftlab.decoding.step import Block, tree_layout
from tests.tiers import exhaustive, slow

pytestmark = pytest.mark.integration

PROMPTS = [
    "Write a Python function that returns the squares of a list of numbers, then show how to call it.",
    "Rewrite this code with type hints and return it whole:\ndef add(a, b):\n    total = a + b\n    return total\n",
]
DRAFT = "model:smollm2-135m"  # the target's own GGUF as a draft: it runs in its own llama.cpp context (repacked)
DRAFTERS = ("ngram", DRAFT, f"tree:2x2:{DRAFT}", f"merged:ngram/{DRAFT}", f"staged:ngram/{DRAFT}")
KEPT = {(f"tree:2x2:{DRAFT}", 2), (f"tree:2x2:{DRAFT}", 3), (f"merged:ngram/{DRAFT}", 3), (DRAFT, 3), (f"staged:ngram/{DRAFT}", 3)}


@pytest.fixture(scope="module")
def target():
    return load_model("smollm2-135m", backend="llamacpp")


@pytest.fixture(scope="module")
def plain_rows(target):
    """A fresh backend, a 21-token prefix prefilled, then 24 greedy tokens scored one at a time: (tokens, rows)."""
    backend = LlamaCppBackend(target.model)
    backend.score(list(range(100, 120)), last_only=True)
    tokens, rows = [120], []
    for _ in range(24):
        row = backend.score(tokens[-1:])[0]  # [V]
        rows.append(row)
        tokens.append(int(row.argmax()))
    return backend, tokens, rows


@pytest.fixture(scope="module")
def reference(target):
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    return [plain.generate(p, max_new_tokens=40).token_ids for p in PROMPTS]


def test_the_model_runs_as_shipped(target):
    assert target.engine.runs_gguf and target.precision == "Q4_1"
    assert target.vocab_size == 49152 and target.num_parameters() > 100_000_000


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3, 4, 8, 16])
def test_block_rows_are_bitwise_single_rows(plain_rows, n):
    backend, tokens, rows = plain_rows
    backend.rollback(20)
    block = backend.score(tokens[:n])  # [n, V]
    assert all(torch.equal(block[i], rows[i]) for i in range(n))


@pytest.mark.slow
def test_block_rows_are_bitwise_single_rows_after_a_long_prompt(target):
    """Past ~256 cached tokens llama.cpp's flash attention rounds blocks differently: the backend must not use it."""
    backend = LlamaCppBackend(target.model)
    prompt = [100 + (i * 37) % 20000 for i in range(600)]
    backend.score(prompt, last_only=True)
    tokens, rows = [5], []
    for _ in range(8):
        rows.append(backend.score(tokens[-1:])[0])
        tokens.append(int(rows[-1].argmax()))
    backend.rollback(600)
    block = backend.score(tokens[:8])  # [8, V]
    assert all(torch.equal(block[i], rows[i]) for i in range(8))


@pytest.mark.slow
def test_a_tree_scores_every_branch_exactly_and_keeps_a_scattered_path(plain_rows):
    """The first branch is wrong: the kept path lies in scattered cells, and what follows must still be exact."""
    backend, tokens, rows = plain_rows
    backend.rollback(20)
    wrong = (tokens[1] + 1) % 49152
    logits = backend.score_block(Block([tokens[0], wrong, tokens[1], wrong, tokens[2]], (-1, 0, 0, 1, 2))).logits
    assert torch.equal(logits[0], rows[0]) and torch.equal(logits[2], rows[1]) and torch.equal(logits[4], rows[2])
    backend.keep([0, 2, 4])
    assert backend.cache_len == 23
    after = backend.score(tokens[3:7])  # [4, V]
    assert all(torch.equal(after[i], rows[3 + i]) for i in range(4))


@pytest.mark.slow
def test_a_forest_scored_then_rolled_back_leaves_the_cache_as_it_was(plain_rows):
    backend, tokens, rows = plain_rows
    backend.rollback(21)  # the cache holds the prefix and tokens[0]
    forest = backend.score_block(Block([tokens[1], 7, tokens[2]], (-1, -1, 0))).logits  # two roots, as drafts score
    assert torch.equal(forest[0], rows[1]) and torch.equal(forest[2], rows[2])
    backend.rollback(21)
    assert torch.equal(backend.score(tokens[1:2])[0], rows[1])


@pytest.mark.slow
def test_llama_cpp_logs_reach_standard_error_for_errors_only(capsys):
    from draftlab.backends.gguf import GGML_LOG_LEVEL_ERROR, _errors_only, llama_lib

    llama_lib()
    callback = _errors_only()
    for level in range(6):
        callback(level, f"level {level}\n".encode(), None)
    assert capsys.readouterr().err == f"level {GGML_LOG_LEVEL_ERROR}\n"


@pytest.mark.slow
def test_tree_bookkeeping():
    parents = (-1, 0, 0, 1, 2, 2)
    layout = tree_layout(parents)
    order = dfs_order(parents, layout.children)
    assert order == [0, 1, 3, 2, 4, 5]
    assert leaves_below(layout.children, order)[2] == [4, 5]
    assert [order[i] for i in inverse(order)] == list(range(6)) and inverse(order)[3] == 2


@pytest.mark.parametrize("drafter,k", [("ngram", 3), *(  # ngram K=3: the smoke test; CI: each drafter at a middle K
    slow(d, k) if (d, k) in KEPT else exhaustive(d, k) for d in DRAFTERS for k in (1, 2, 3, 5, 8) if (d, k) != ("ngram", 3))])
def test_greedy_equals_plain_decoding_on_llamacpp(target, reference, drafter, k):
    decoder = SpeculativeDecoder.from_names(target, drafter=drafter, k=k)
    assert decoder.target_backend.batch_invariant
    for prompt, expected in zip(PROMPTS, reference):
        assert decoder.generate(prompt, max_new_tokens=40).token_ids == expected


@pytest.mark.slow
def test_plain_decoding_on_repacked_kernels_is_the_same_text_here(target, reference):
    """Q4_1 has no repacked kernels on x86: llama.cpp's default plain decoding gives the exact kernels' output, and
    its rows are exact too (draftlab's build: `REPACK_EXACT`)."""
    fast = SpeculativeDecoder.from_names("smollm2-135m", drafter="none", k=1, backend="llamacpp", numerics="repack")
    assert fast.target.model.repack and fast.target_backend.batch_invariant
    assert fast.generate(PROMPTS[0], max_new_tokens=40).token_ids == reference[0]


@pytest.mark.slow
def test_sampling_is_reproducible_and_drafts_change_nothing_at_one_seed_per_draft(target):
    """Same seed, same draft: same tokens; the statistical check of the distribution is `draftlab audit` (slow test)."""
    decoder = SpeculativeDecoder.from_names(target, drafter="ngram", k=3)
    first = decoder.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, seed=3).token_ids
    assert decoder.generate(PROMPTS[0], max_new_tokens=24, temperature=0.8, seed=3).token_ids == first


@pytest.mark.slow
@pytest.mark.exhaustive
def test_the_audit_passes_on_llamacpp(tmp_path):
    """Speculative sampling on llama.cpp keeps the target's distribution (chi-square against plain sampling and
    the exact first-token distribution), with a model draft in its own context and with n-gram lookup."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "draftlab.cli", "audit", "--backend", "llamacpp", "--drafters", "ngram",
                          DRAFT, "--k", "3", "--samples", "150", "--budget", "150", "--top-p", "0.9"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "PASS" in out.stdout


@pytest.mark.slow
def test_drafts_built_from_torch_weights_are_refused_clearly(target):
    with pytest.raises(DraftlabError, match="torch weights; on --backend llamacpp use ngram, suffix, layers:LIST"):
        SpeculativeDecoder.from_names(target, drafter="designed", k=2)  # a layer draft runs (tests/test_gguf_layers.py)


@pytest.mark.slow
def test_bad_inputs_get_one_line_errors(tmp_path):
    with pytest.raises(DraftlabError, match="GGUF's own weight types"):
        load_model("smollm2-135m", dtype="bf16", backend="llamacpp")
    with pytest.raises(DraftlabError, match="loads GGUF files"):
        load_model(str(tmp_path), backend="llamacpp")
    with pytest.raises(DraftlabError, match="numerics on llama.cpp"):
        SpeculativeDecoder.from_names("smollm2-135m", drafter="none", backend="llamacpp", numerics="fp32 exact-wm/2")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(DraftlabError):
        load_model(str(broken), backend="llamacpp")


@pytest.mark.slow
def test_llama_cpp_pythons_own_generate_and_prompt_lookup(target, reference):
    """Its plain decoding and its lookup run on one instance: one prefill of a prompt serves both, and the lookup
    from it gives the plain decoding's tokens, as the lookup does from a prefill of its own."""
    from draftlab.contenders.llama_cpp_python import LlamaCppPeer
    from draftlab.measure import DECODE, EncodedPrompt, RunSettings, run_once
    from draftlab.measure.loop import prefill_once

    peer = LlamaCppPeer(gguf_path("smollm2-135m"))
    ids = encode_prompt(target.tokenizer, PROMPTS[1])
    prompt, greedy, eos = EncodedPrompt("p", "", ids), SamplingConfig(), eos_ids(target)
    plain = peer.generate(ids, 40, eos, greedy, 0)
    alone = run_once("lookup", peer.contender(eos, k=3), prompt, RunSettings(40))
    contenders = [peer.contender(eos, 0), peer.contender(eos, k=3)]
    records = prefill_once(contenders, prompt)
    assert list(records) == ["llama-cpp-python"]  # one prefill for both
    shared = run_once("lookup", contenders[1], prompt, RunSettings(40), records["llama-cpp-python"].seconds)
    after = run_once("plain", contenders[0], prompt, RunSettings(40), records["llama-cpp-python"].seconds)
    assert 0 < len(plain) <= 40 and (len(plain) == 40 or plain[-1] in eos) and alone.stats.wall_s > 0
    assert alone.seconds(DECODE) is None  # the library times no prefill apart
    assert alone.token_ids == shared.token_ids == after.token_ids == plain  # lossless against its own plain decoding
    assert shared.stats.prefill_s == records["llama-cpp-python"].seconds


@pytest.mark.slow
def test_only_a_trees_first_branch_counts_as_exact(plain_rows):
    """Other branches' cells are shifted from their positions: greedy decoding re-verifies a path through them."""
    backend, tokens, rows = plain_rows
    assert backend.exact_rows(Block([1, 2, 3, 4, 5], (-1, 0, 0, 1, 2))) == {0, 1, 3}
    assert backend.exact_rows(Block.chain([1, 2, 3])) == {0, 1, 2}
