"""The engine's one batched step under `draftlab serve` on the real SmolLM2 (pure Q4_0 on the exact kernels): the
step that `draftlab generate`, a study's cell and a served request all run; `--k auto`; prompts of 20-2000 tokens
prefilled in chunks between the steps of the requests decoding, each request's tokens still those it gets alone."""

from __future__ import annotations

import threading

import pytest

from draftlab.api import SpeculativeDecoder
from draftlab.backends.llamacpp_sequences import LlamaCppSequences
from draftlab.engine import SpeculativeEngine
from draftlab.measure import EncodedPrompt, RunSettings, measure_prompt
from draftlab.serving.build import ServeSettings, build_served
from draftlab.serving.scheduler import LoadK
from tests.serve_jobs import TARGET, prompts, serve_jobs, target  # noqa: F401 (the fixtures)
from tests.tiers import exhaustive, slow

pytestmark = pytest.mark.integration
TOKENS = 32


@pytest.fixture(scope="module")
def decoder(target):
    return SpeculativeDecoder.from_names(target, drafter="none", k=1, backend="llamacpp")


def test_generate_a_cell_and_a_served_request_run_the_one_step_on_the_one_llama_cpp_backend(monkeypatch, decoder,
                                                                                              prompts):
    calls: list[int] = []  # runs a step
    scored: list[int] = []  # sequences a call into llama.cpp's backend scores
    step, score_blocks = SpeculativeEngine.step, LlamaCppSequences.score_blocks

    def counted(engine, runs):
        calls.append(len(runs))
        return step(engine, runs)

    def scoring(sequences, blocks, *args, **kwargs):
        scored.append(len(blocks))
        return score_blocks(sequences, blocks, *args, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "step", counted)
    monkeypatch.setattr(LlamaCppSequences, "score_blocks", scoring)
    out = decoder.generate(prompts[0], max_new_tokens=12, temperature=0)
    assert len(calls) == out.stats.steps == 12 and scored == [1] * 12
    measure_prompt({"plain": decoder}, EncodedPrompt("p", "qa", prompts[1]), RunSettings(10, temperature=0))
    assert len(calls) == len(scored) == 12 + 10
    served = build_served(ServeSettings(TARGET, "ngram", None, slots=2, context=2048))
    built = len(scored)  # the server's startup times blocks through it too
    served.scheduler.start()
    try:
        answers = serve_jobs(served, [(prompts[0], 12, 0.0), (prompts[2], 12, 0.0)])
    finally:
        served.scheduler.stop()
    assert answers[0] == out.token_ids
    served_steps = calls[22:]
    assert served_steps and served.metrics.batches == len(served_steps) and max(served_steps) == 2
    assert len(scored) - built == len(served_steps) and max(scored[built:]) == 2  # both requests' blocks in one call


@pytest.mark.parametrize("target_name, drafter", [slow(TARGET, "ngram"), exhaustive(TARGET, "suffix"),
                                                  slow("smollm2-135m@IQ4_NL", "ngram")])
def test_long_prompts_prefill_in_chunks_beside_decoding_and_each_request_decodes_as_alone(prompts, target_name,
                                                                                         drafter):
    """Prompts of 20 to ~2000 tokens, the long ones joining while short ones decode, `--k auto`: each request's
    greedy tokens equal `draftlab generate`'s plain decoding, and the long prompts' chunks were prefilled between
    the steps of requests decoding. IQ4_NL prefills on its repacked twin, whose rows depend on the chunks: they lie
    where a whole prefill puts them."""
    decoder = SpeculativeDecoder.from_names(target_name, drafter="none", k=1, backend="llamacpp")
    long = [prompts[5] + prompts[1] + prompts[0] + prompts[4], prompts[5] + prompts[3]]  # ~1790 and ~1410 tokens
    assert 1700 <= len(long[0]) <= 2000 and len(long[1]) > 1024
    mixed = [prompts[2][:20], long[0], prompts[6], long[1], prompts[7]]
    alone = [decoder.generate(ids, max_new_tokens=TOKENS, temperature=0).token_ids for ids in mixed]
    served = build_served(ServeSettings(target_name, drafter, None, slots=4, context=4096))
    served.scheduler.start()
    try:
        answers = serve_jobs(served, [(mixed[0], TOKENS, 0.0), (mixed[2], TOKENS, 0.0), (mixed[1], TOKENS, 0.05),
                                      (mixed[3], TOKENS, 0.0), (mixed[4], TOKENS, 0.3)])
    finally:
        served.scheduler.stop()
    assert [answers[0], answers[2], answers[1], answers[3], answers[4]] == alone
    metrics = served.metrics
    assert metrics.prefill_chunks >= 4 + 3 + 3  # 1790 tokens in 4 chunks of 512, 1410 in 3, and the short ones
    assert metrics.prefill_chunks_beside >= 4  # long prompts' chunks between the steps of requests decoding
    assert metrics.drafted > 0


def test_a_short_prompt_behind_a_long_ones_chunks_is_answered_first_each_as_alone(prompts, decoder):
    """A ~1790-token prompt (4 chunks) admitted first and a short one beside it: the short one prefills first and
    answers first; both answers are plain decoding's alone."""
    from draftlab.engine import GenerationConfig
    from draftlab.serving.scheduler import Job

    long, short = prompts[5] + prompts[1] + prompts[0] + prompts[4], prompts[2][:30]
    alone = [decoder.generate(ids, max_new_tokens=8, temperature=0).token_ids for ids in (long, short)]
    served = build_served(ServeSettings(TARGET, "ngram", None, slots=2, context=4096))
    chunks: list[int] = []  # the prompt length of each chunk prefilled, in turn
    engine = served.scheduler.engine
    prefill_part = engine.prefill_part

    def counted(run):
        chunks.append(run.prompt_length)
        prefill_part(run)

    engine.prefill_part = counted
    firsts: list[int] = []
    answers: list[list[int]] = [[], []]
    done = [threading.Event(), threading.Event()]

    def sink(i: int):
        def emit(kind: str, value) -> None:
            if kind == "tokens":
                if not answers[i]:
                    firsts.append(i)
                answers[i].extend(value)
            else:
                done[i].set()
        return emit

    for i, ids in enumerate((long, short)):  # both waiting before the scheduler runs: admitted together
        served.scheduler.submit(Job(ids, GenerationConfig(max_new_tokens=8, eos_token_ids=served.eos_ids), sink(i)))
    served.scheduler.start()
    try:
        assert all(event.wait(120) for event in done)
    finally:
        served.scheduler.stop()
    assert chunks == [len(short)] + [len(long)] * 4 and firsts == [1, 0] and answers == alone


def test_k_auto_weighs_rows_by_a_profiles_block_costs_where_they_are_the_servers_numerics(tmp_path, monkeypatch,
                                                                                          target):
    """`--cost-profile`: the curve a profile timed on the server's own numerics, nothing timed at startup; a profile
    of other numerics is one line."""
    from draftlab.backends.llamacpp import LlamaCppBackend
    from draftlab.errors import DraftlabError
    from draftlab.perf.calibrate import Profile
    from draftlab.perf.throughput import TargetProfile
    from draftlab.serving import build

    path = tmp_path / "profile.json"
    numerics = LlamaCppBackend(target.model).numerics
    Profile(TargetProfile("smollm2", {1: 0.010, 2: 0.011, 4: 0.013, 9: 0.020}), numerics=numerics).save(path)
    monkeypatch.setattr(build, "block_cost", lambda *args: pytest.fail("the blocks were timed at startup"))
    settings = ServeSettings(TARGET, "suffix", None, slots=2, context=1024, cost_profile=str(path))
    chooser = build_served(settings).scheduler.engine.chooser
    assert chooser.cost.points == ((1, 0.010), (2, 0.011), (4, 0.013), (9, 0.020))
    Profile(TargetProfile("smollm2", {1: 0.010, 2: 0.011}), numerics=numerics.replace("Q4_0", "Q4_K - Medium")
            ).save(path)
    with pytest.raises(DraftlabError, match="not this server's"):
        build_served(settings)
    with pytest.raises(DraftlabError, match="has none to price"):
        ServeSettings(TARGET, "suffix", LoadK.fixed(3), cost_profile=str(path))
