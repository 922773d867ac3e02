"""Draft models, EAGLE-3 and its token trees served (`draftlab serve --drafter model:...`, `eagle3`, `tree:...`) on
the real SmolLM2 (pure Q4_0 on the exact kernels): each request's draft in a stream of its own, every draft position
of the requests in flight in one decode of the draft, every request's tree verified in one decode; each request's
greedy tokens those of `draftlab generate`'s plain decoding alone and under load, and each draft stream empty once
its request retires. The Qwen pair (the seeds' headline) in the slow tier."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from draftlab import compose
from draftlab.api import SpeculativeDecoder, prompt_ids
from draftlab.contenders.draftlab_serve import SERVED_NAME, DraftlabServer, ServeConfig
from draftlab.decoding.sampling import SamplingConfig
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.files.datasets import load_prompts
from draftlab.models import load_model
from draftlab.serving.build import ServeSettings, build_served
from draftlab.serving.scheduler import LoadK
from tests.integration.test_qwen_pair import pytestmark as qwen_marks
from tests.integration.test_serve import gauge, metrics_text, running_counts
from tests.required import OPENAI, module_or_skip
from tests.serve_jobs import TARGET, prompts, serve_configs, serve_jobs, target  # noqa: F401 (the fixtures)

pytestmark = pytest.mark.integration
TOKENS = 32
qwen_skip = next(m for m in qwen_marks if m.name == "skipif")
DRAFT = "layers:0-5"  # a small draft of SmolLM2: its first 6 of 30 layers and its head, a GGUF of its own


@pytest.fixture(scope="module")
def plain(target, prompts):
    decoder = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend="llamacpp")
    return [decoder.generate(ids, max_new_tokens=TOKENS, temperature=0).token_ids for ids in prompts]


@pytest.mark.parametrize("drafter", ["model:smollm2-135m", "eagle3", "tree:2x2:eagle3"])
def test_a_started_server_with_a_draft_answers_each_request_as_alone(tmp_path, prompts, plain, drafter):
    """A draft model, the shipped EAGLE-3 draft (reading the target's layers from the batch's decode, a draft cache
    per request), or a token tree of it (each request's tree in its KV stream, verified beside the others' in one
    decode): 8 prompts alone, then 4 at once through the official client: every answer is draftlab generate's plain
    decoding; /metrics shows the 4 running together and the draft's tokens accepted."""
    openai = module_or_skip("openai", OPENAI, "the official openai client is not installed (pip install -e .[test])")
    config = ServeConfig(TARGET, drafter, "1:3", slots=4, context=2048)
    with DraftlabServer(config, tmp_path) as server:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)

        def ask(ids: list[int]) -> list[int]:
            return client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=TOKENS, temperature=0,
                                             extra_body={"return_token_ids": True}).choices[0].token_ids

        assert [ask(ids) for ids in prompts] == plain
        chosen = [i for i, ids in enumerate(plain) if len(ids) == TOKENS][:4]
        with running_counts(server) as running, ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: ask(prompts[i]), chosen))
        assert answers == [plain[i] for i in chosen] and max(running) == 4
        text = metrics_text(server)
    assert gauge(text, "spec_decode_num_draft_tokens_total") > 0 and gauge(text, "spec_decode_num_accepted_tokens_total") > 0


def test_every_draft_position_of_the_requests_in_flight_is_one_decode(monkeypatch, prompts, plain):
    """With 4 requests at K=3, each step's drafting costs as many decodes of the draft as its deepest draft (not one
    per request and position), and each request decodes as alone, 4 at a time and joining mid-decode; /metrics
    counts the draft's passes and the steps' draft positions."""
    served = build_served(ServeSettings(TARGET, DRAFT, LoadK.parse("1:3"), slots=4, context=2048))
    streams = served.scheduler.engine.drafter.streams
    per_step: list[tuple[int, int, int]] = []  # (draft decodes, deepest draft, drafting runs)
    step = SpeculativeEngine.step

    def counted(engine, runs):
        before = streams.decodes
        stepped = step(engine, runs)
        per_step.append((streams.decodes - before, max(stepped.drafted), sum(d > 0 for d in stepped.drafted)))
        return stepped

    monkeypatch.setattr(SpeculativeEngine, "step", counted)
    served.scheduler.start()
    try:
        answers = serve_jobs(served, [(ids, TOKENS, 0.05 * (i % 4)) for i, ids in enumerate(prompts)])
    finally:
        served.scheduler.stop()
    assert answers == plain
    together = [(decodes, deepest) for decodes, deepest, runs in per_step if runs >= 3]
    assert len(together) >= 10
    assert all(decodes == deepest for decodes, deepest in together), [t for t in together if t[0] != t[1]]
    assert served.metrics.drafted > 0 and served.metrics.accepted > 0
    text = served.metrics.text()  # /metrics counts both: a benchmark reads them from a started server
    assert gauge(text, "draft_passes_total") == streams.decodes
    assert gauge(text, "draft_positions_total") == sum(deepest for _, deepest, _ in per_step)


def test_a_cut_vocabulary_draft_is_served_on_its_trimmed_head(prompts, plain):
    """`model:NAME,head=N` (a cut draft: its GGUF's head trimmed to N rows, each row mapped to its token id) in a
    stream per slot, 4 requests at a time: the streams' logits are the N rows, every answer as alone."""
    served = build_served(ServeSettings(TARGET, "model:smollm2-135m,head=4096", LoadK.parse("1:3"), slots=4,
                                        context=2048))
    streams = served.scheduler.engine.drafter.streams
    assert streams.score({3: [1]})[3].shape == (1, 4096)
    streams.rollback(3, 0)
    served.scheduler.start()
    try:
        answers = serve_jobs(served, [(ids, TOKENS, 0.05 * (i % 4)) for i, ids in enumerate(prompts)])
    finally:
        served.scheduler.stop()
    assert answers == plain and served.metrics.drafted > 0 and served.metrics.accepted > 0


def draft_held(served, drafter: str) -> list[int]:
    """Positions each slot's draft holds: a draft model's stream, an EAGLE-3 draft's cache."""
    if drafter == DRAFT:
        return [served.scheduler.engine.drafter.streams.length(s) for s in range(4)]
    return [lane.drafter.held_positions() for lane in served.scheduler.lanes]


@pytest.mark.parametrize("drafter, ks", [(DRAFT, "1:2"), ("eagle3", "auto")])
def test_each_draft_stream_is_empty_once_its_request_retires_after_200_requests(prompts, drafter, ks):
    """200 short requests through 4 slots, a draft model or an EAGLE-3 draft drafting: every answer as alone, and
    every stream of the draft (and of the target, no prompt cache) empty once the last retires. The EAGLE-3 draft
    under `--k auto`, which has no streams to calibrate at startup: the steps' drafting times price its rows."""
    served = build_served(ServeSettings(TARGET, drafter, None if ks == "auto" else LoadK.parse(ks), slots=4,
                                        max_waiting=200, context=2048, prompt_cache=False))
    decoder = SpeculativeDecoder.from_names(TARGET, drafter="none", k=1, backend="llamacpp")
    short = [ids[:16 + 3 * i] for i, ids in enumerate(prompts)]
    alone = [decoder.generate(ids, max_new_tokens=2, temperature=0).token_ids for ids in short]
    served.scheduler.start()
    try:
        answers = serve_jobs(served, [(short[i % 8], 2, 0.0) for i in range(200)])
    finally:
        served.scheduler.stop()
    assert answers == [alone[i % 8] for i in range(200)]
    target = served.scheduler.engine.sequences
    assert draft_held(served, drafter) == [0] * 4 and [target.length(s) for s in range(4)] == [0] * 4
    assert served.metrics.drafted > 0
    if ks == "auto":
        assert served.scheduler.engine.chooser.draft_row_s > 0


def test_a_sampled_request_served_with_a_tree_is_the_request_alone(prompts):
    """Sampled (temperature 0.8, top-k 20, a seed each), 4 requests at once with a 2x2 tree of the EAGLE-3 draft,
    every tree verified in one decode: each request's tokens are those `draftlab generate` samples alone with its
    seed, so serving keeps the target's distribution as the engine alone does (tests/test_trees.py)."""
    sampling, ids = SamplingConfig(0.8, top_k=20), [p[:200] for p in prompts[:4]]
    decoder = SpeculativeDecoder.from_names(TARGET, drafter="tree:2x2:eagle3", k=3, backend="llamacpp")
    alone = [decoder.generate(p, max_new_tokens=24, temperature=0.8, top_k=20, seed=7 + i).token_ids
             for i, p in enumerate(ids)]
    served = build_served(ServeSettings(TARGET, "tree:2x2:eagle3", LoadK.fixed(3), slots=4, context=2048))
    served.scheduler.start()
    try:
        together = serve_configs(served, [(p, GenerationConfig(24, sampling, seed=7 + i, eos_token_ids=served.eos_ids),
                                           0.0) for i, p in enumerate(ids)])
    finally:
        served.scheduler.stop()
    assert together == alone and served.metrics.drafted > 0


@qwen_skip  # the Qwen pair's: cached, or DRAFTLAB_QWEN=1
@pytest.mark.slow  # ~90 s on an AVX-512 host, ~150 s on an AVX2-only one
def test_a_started_server_with_the_qwen_pair_answers_each_request_as_alone(tmp_path):
    """The seeds' headline pair served: Qwen2.5-Coder 1.5B (pure Q4_0) with its 0.5B draft at K=3 in a started
    server, 4 code prompts alone and then 4 at once through the official client: every answer is draftlab generate's
    plain decoding, and /metrics shows the 4 running together and the draft's tokens accepted. A fixed K, so the draft
    drafts on every host (`--k auto` weighs the draft's cost on this host's speed: on an AVX2-only host it decodes
    plainly)."""
    openai = module_or_skip("openai", OPENAI, "the official openai client is not installed (pip install -e .[test])")
    target = load_model("qwen2.5-coder-1.5b@Q4_0_PURE", backend="llamacpp")
    ids = [prompt_ids(target.tokenizer, p) for p in load_prompts("humaneval", 4)]
    decoder = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend="llamacpp")
    plain = [decoder.generate(p, max_new_tokens=TOKENS, temperature=0).token_ids for p in ids]
    config = ServeConfig("qwen2.5-coder-1.5b@Q4_0_PURE", "model:qwen2.5-coder-0.5b", "1:3", slots=4, context=2048)
    with DraftlabServer(config, tmp_path) as server:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)

        def ask(prompt: list[int]) -> list[int]:
            return client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=TOKENS, temperature=0,
                                             extra_body={"return_token_ids": True}).choices[0].token_ids

        alone = [ask(p) for p in ids]
        with running_counts(server) as running, ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, ids))
        text = metrics_text(server)
    assert alone == plain and together == plain and max(running) == 4  # the 4 decoded together
    assert gauge(text, "spec_decode_num_draft_tokens_total") > 0 and gauge(text, "spec_decode_num_accepted_tokens_total") > 0


@pytest.mark.slow  # torch's exact route on the CPU: ~40 s
def test_a_started_torch_server_with_a_token_tree_answers_each_request_as_alone(tmp_path, monkeypatch):
    """`tree:2x2:eagle3` served on torch (a backend per slot scores each slot's tree, the EAGLE-3 draft per request):
    8 prompts alone equal draftlab generate's plain decoding on the same route, 4 at once each equal itself alone;
    on a llama.cpp library without draftlab's stream-leaves patch the tree is refused at startup in one line."""
    openai = module_or_skip("openai", OPENAI, "the official openai client is not installed (pip install -e .[test])")
    target = load_model("smollm2-135m")
    ids = [prompt_ids(target.tokenizer, p)[:160] for p in load_prompts("heldout", 8)]  # prefills kept short
    config = ServeConfig("smollm2-135m", "tree:2x2:eagle3", "1:3", slots=4, context=512, backend="auto")
    with DraftlabServer(config, tmp_path) as server:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)

        def ask(prompt: list[int]) -> list[int]:
            return client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=16, temperature=0,
                                             extra_body={"return_token_ids": True}).choices[0].token_ids

        alone = [ask(p) for p in ids]
        with running_counts(server) as running, ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, ids[:4]))
        text = metrics_text(server)
    decoder = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend="auto")
    assert alone == [decoder.generate(p, max_new_tokens=16, temperature=0).token_ids for p in ids]
    assert together == alone[:4] and max(running) >= 3
    assert gauge(text, "spec_decode_num_accepted_tokens_total") > 0
    monkeypatch.setattr(compose, "sequence_ids", lambda: 0)  # what a library without the patch reports
    with pytest.raises(DraftlabError, match="verifies token trees in one sequence only"):
        build_served(ServeSettings(TARGET, "tree:2x2:eagle3", None, slots=2, context=512))
