"""Integration tests on the real SmolLM2-135M-Instruct, fetched from PyPI (the embedded default target)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from draftlab.api import SpeculativeDecoder, encode_prompt
from draftlab.drafters import check_compatible
from draftlab.errors import DraftlabError
from draftlab.models import DTYPES, LoadedModel, auto_dtype, load_model
from tests.tiers import exhaustive, slow

pytestmark = pytest.mark.integration
SLOW = pytest.mark.slow  # the rest of the real-model suite: `pytest -m slow` (CI runs it); unmarked tests are the smoke set

PROMPTS = [
    "Write a Python function that returns the squares of a list of numbers, then show how to call it.",
    "Summarize in one sentence: The city council voted on Tuesday to extend the bike lane network by "
    "twenty kilometres, citing a rise in cycling commuters and fewer traffic accidents on streets with lanes.",
]


@pytest.fixture(scope="module")
def target() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def baseline(target):
    ar = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    return [ar.generate(p, max_new_tokens=32).token_ids for p in PROMPTS]


@pytest.mark.parametrize("drafter", ["ngram", exhaustive("layers:0-3"), exhaustive("layers:0-29:3"),
                                     slow("model:smollm2-135m")])  # ngram: the README's smoke test for torch
def test_greedy_equals_autoregressive_fp32(target, baseline, drafter):
    for k in (1, 3, 8):  # K 2 and 5: the unit tests' tiny models, and the slow tier's study cells
        decoder = SpeculativeDecoder.from_names(target, drafter=drafter, k=k)
        for prompt, expected in zip(PROMPTS, baseline):
            result = decoder.generate(prompt, max_new_tokens=32)
            assert result.token_ids == expected, f"{drafter} k={k}"


@pytest.mark.parametrize("drafter", ["designed", exhaustive("tree:2x2:designed"), exhaustive("tree:dyn-2-6@0.05:designed"),
                                     exhaustive("tree:2:layers:0-3")])
@SLOW
def test_designed_draft_and_trees_are_lossless(target, baseline, drafter):
    """The shipped feature draft, chains and trees of it (and a tree of a layer draft): plain decoding's output."""
    accepted = 0
    for k in (1, 2, 4):
        decoder = SpeculativeDecoder.from_names(target, drafter=drafter, k=k)
        for prompt, expected in zip(PROMPTS, baseline):
            result = decoder.generate(prompt, max_new_tokens=32)
            assert result.token_ids == expected, f"{drafter} k={k}"
            accepted += result.stats.accepted
    assert accepted > 0


# CI leaves both to the exhaustive remainder: tests/test_eagle3.py proves chains and trees at K 1-5 in the default tier,
# and tests/integration/test_serve_drafts.py serves tree:2x2:eagle3 on this model and route (bf16) in the slow tier
@pytest.mark.parametrize("dtype", [exhaustive("fp32"), exhaustive("bf16")])  # bf16: bit for bit
def test_the_eagle3_draft_chains_and_trees_are_lossless(dtype):
    """The shipped EAGLE-3 draft (it reads target layers 2, 15 and 27), as chains and trees at K 1-5, in fp32 and in
    bf16 (where blocks are scored batch-invariantly): plain decoding's output, with drafts accepted."""
    target = load_model("smollm2-135m", dtype=dtype)
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    expected = [plain.generate(p, max_new_tokens=24).token_ids for p in PROMPTS]
    for drafter in ("eagle3", "tree:2x2:eagle3"):
        accepted = 0
        for k in (1, 2, 3, 4, 5):
            decoder = SpeculativeDecoder.from_names(target, drafter=drafter, k=k)
            for prompt, reference in zip(PROMPTS, expected):
                result = decoder.generate(prompt, max_new_tokens=24)
                assert result.token_ids == reference, f"{drafter} {dtype} k={k}"
                accepted += result.stats.accepted
        assert accepted > 0, f"{drafter} {dtype} accepted nothing: later block rows went unchecked"


@pytest.mark.slow
def test_transformers_backend_gives_the_same_output(target, baseline):
    decoder = SpeculativeDecoder.from_names(target, drafter="ngram", k=4, backend="hf")
    assert decoder.generate(PROMPTS[0], max_new_tokens=32).token_ids == baseline[0]
    ar = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend="hf")
    assert ar.generate(PROMPTS[1], max_new_tokens=32).token_ids == baseline[1]


@pytest.mark.slow
def test_self_draft_accepts_everything(target):
    decoder = SpeculativeDecoder.from_names(target, drafter="model:smollm2-135m", k=4)
    stats = decoder.generate(PROMPTS[0], max_new_tokens=30).stats
    assert stats.acceptance_rate == 1.0 and stats.tokens_per_step == 5.0


@pytest.mark.parametrize("drafter", [slow("ngram"), exhaustive("layers:0-3"), slow("designed"),
                                     exhaustive("tree:2x2:designed")])
def test_greedy_equals_autoregressive_bf16_bit_for_bit(drafter):
    """In bf16 the fast backend scores blocks batch-invariantly: greedy output equals plain decoding exactly.

    The test fails when it tests nothing: the weights must be bf16, the backend invariant, and the
    speculative runs must verify multi-token blocks.
    """
    target = load_model("smollm2-135m", dtype="bf16")
    assert {p.dtype for p in target.model.parameters()} == {torch.bfloat16}
    ar = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    assert ar.target_backend.batch_invariant
    expected = [ar.generate(p, max_new_tokens=24).token_ids for p in PROMPTS]
    for k in (1, 2, 3, 5, 8):
        sps = SpeculativeDecoder.from_names(target, drafter=drafter, k=k)
        drafted = accepted = 0
        for prompt, reference in zip(PROMPTS, expected):
            result = sps.generate(prompt, max_new_tokens=24)
            assert result.token_ids == reference, f"{drafter} k={k}"
            drafted, accepted = drafted + result.stats.drafted, accepted + result.stats.accepted
        assert drafted > 0, f"{drafter} k={k}: no multi-token block was scored"
    if drafter in ("ngram", "designed", "tree:2x2:designed"):
        assert accepted > 0, f"{drafter} accepted nothing: later block rows went unchecked"


@pytest.mark.slow
@pytest.mark.parametrize("dtype, expected", [("auto", DTYPES[auto_dtype("cpu", "smollm2-135m")[0]]), ("fp32", torch.float32),
                                             ("bf16", torch.bfloat16)])
def test_dtype_flag_loads_that_dtype(dtype, expected):
    """Each --dtype value loads the weights in that dtype (auto: what the CPU multiplies fastest)."""
    target = load_model("smollm2-135m", dtype=dtype)
    assert {p.dtype for p in target.model.parameters()} == {expected}
    decoder = SpeculativeDecoder.from_names(target, drafter="layers:0-1", k=2)
    assert decoder.target_backend.dtype == expected
    assert {p.dtype for p in decoder.draft_model.model.parameters()} == {expected}


@pytest.mark.slow
def test_tokenizer_mismatch_is_refused(target):
    other = LoadedModel("other", target.model, _ShiftedTokenizer(target.tokenizer), target.device, target.dtype)
    with pytest.raises(DraftlabError, match="different tokenizers"):
        check_compatible(target, other)


class _ShiftedTokenizer:
    """A tokenizer whose vocabulary maps two tokens differently."""

    def __init__(self, tokenizer):
        self.vocab = dict(tokenizer.get_vocab())
        a, b = list(self.vocab)[100:102]
        self.vocab[a], self.vocab[b] = self.vocab[b], self.vocab[a]

    def get_vocab(self):
        return self.vocab


def draftlab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftlab.cli", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_generate_json():
    out = draftlab("generate", "--drafter", "ngram", "--k", "3", "--max-new-tokens", "24", "--json",
                   "--prompt", PROMPTS[0])
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("text", "new_tokens", "steps", "tokens_per_step", "acceptance_rate", "draft_s", "target_s",
                "wall_s", "tokens_per_s"):
        assert key in record
    assert record["new_tokens"] == 24 and record["text"]
    assert record["tokens_per_step"] == pytest.approx(24 / record["steps"])


@pytest.mark.slow
def test_cli_bench_json(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p, "category": c}) for p, c in zip(PROMPTS, ["code", "sum"])))
    out = draftlab("bench", "--prompts", str(prompts), "--k", "4", "--max-new-tokens", "16", "--warmup", "0", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["prompts"] == 2 and summary["identical"] == 2 and summary["speedup"] > 0
    assert set(summary["categories"]) == {"code", "sum"}
    speeds = summary["host_plain_tokens_per_s"]  # plain decoding in the host's other modes, beside the baseline
    assert speeds["baseline"] > 0 and len(speeds) >= 2 and summary["fastest_plain"] in speeds
    assert summary["speedup_vs_fastest_plain"] <= summary["speedup"] + 1e-9 and "exact" in summary["numerics"]
    assert "speedup" in out.stdout.splitlines()[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "no-such-model"], "unknown model"),
        (["--target", "/nonexistent/model.gguf"], "GGUF file not found"),
        (["--k", "0"], "K (draft tokens per step) must be >= 1"),
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--prompt", "   "], "prompt is empty"),
        (["--max-new-tokens", "9000"], "exceeds the model's context"),
        (["--drafter", "layers:0-40"], "layer indices must be"),
        (["--drafter", "bogus"], "unknown drafter"),
    ],
)
def test_cli_bad_input_is_one_clear_line(args, message, capsys):
    """Each bad input of `draftlab generate` on the real models: exit 2 and one line; the first as a user runs it (a
    process of its own), the others through the same entry point in this one (a process start each is most of
    their cost)."""
    from draftlab.cli import main

    flags = ["generate", *args, *([] if "--prompt" in args else ["--prompt", "Hello"])]
    if args[:2] == ["--target", "no-such-model"]:
        out = draftlab(*flags)
        code, stderr = out.returncode, out.stderr
    else:
        code, stderr = main(flags), capsys.readouterr().err
    assert code == 2
    lines = [line for line in stderr.strip().splitlines() if line.startswith("draftlab: error:")]
    assert len(lines) == 1 and message in lines[0], stderr


@pytest.mark.slow
def test_feature_draft_on_the_real_target_is_lossless(target, baseline):
    """An (untrained) EAGLE-style draft reading SmolLM2's hidden states: same greedy output."""
    from draftlab.engine import GenerationConfig, SpeculativeEngine
    from draftlab.backends import FastLlamaBackend
    from draftlab.drafters.anchored import FeatureDrafter
    from draftlab.drafters.feature import new_feature_draft
    from draftlab.decoding.policy import FixedK

    draft = new_feature_draft(target, torch.arange(4096))
    engine = SpeculativeEngine(FastLlamaBackend(target.model), FeatureDrafter(draft), FixedK(2))
    for prompt, expected in zip(PROMPTS, baseline):
        ids = encode_prompt(target.tokenizer, prompt)
        assert engine.generate(ids, GenerationConfig(max_new_tokens=32)).token_ids == expected


@pytest.mark.slow
def test_questions_prompt_set():
    from draftlab.files.datasets import load_prompts

    prompts = load_prompts("questions", limit=8)
    assert {p.category for p in prompts} == {"finance", "health", "truthfulness", "trivia"}
    assert all(p.chat and p.text.strip() for p in prompts)


@pytest.mark.slow
@pytest.mark.exhaustive  # ~65 s; tests/test_audit.py proves the audit's checks on tiny models in the default tier
def test_audit_passes_draftlab_and_fails_a_broken_verifier(target):
    """The losslessness audit on the real target at temperature 0.8 with two drafters, and a broken verifier."""
    from draftlab.checks.audit import AuditSettings, exact_first_distribution, run_audit
    from tests.test_audit import accept_everything

    prompt_ids = encode_prompt(target.tokenizer, "List three colours, then three animals, then three colours again:")
    sampling_args = {"max_new_tokens": 2, "temperature": 0.8}

    def sampler(decoder):
        return lambda seed: decoder.generate(prompt_ids, seed=seed, **sampling_args).token_ids

    broken = SpeculativeDecoder.from_names(target, drafter="layers:0-3", k=3)
    broken.engine.verifier = accept_everything  # the test hook: a verifier that keeps every draft
    methods = {
        "draftlab ngram K=3": sampler(SpeculativeDecoder.from_names(target, drafter="ngram", k=3)),
        "draftlab layers:0-3 K=3": sampler(SpeculativeDecoder.from_names(target, drafter="layers:0-3", k=3)),
        "broken layers:0-3 K=3": sampler(broken),
    }
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    reference = sampler(plain)
    exact = exact_first_distribution(plain.engine, prompt_ids, __import__("draftlab").SamplingConfig(0.8))
    report = run_audit(reference, methods, exact, AuditSettings(positions=2, samples=100, budget_s=400))
    verdicts = {m.method: m.passed for m in report.methods}
    assert verdicts == {"draftlab ngram K=3": True, "draftlab layers:0-3 K=3": True, "broken layers:0-3 K=3": False}
