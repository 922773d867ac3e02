"""`draftlab serve` on the torch backend: a backend per slot (`BackendSlots`), each request decoded bitwise as
`draftlab generate` decodes it alone, K changing with the load and other requests joining mid-decode.

On the CPU a tiny random Llama; under `pytest -m gpu` (DRAFTLAB_TEST_DEVICE, default cuda) random weights in the
Qwen2.5-1.5B shape in bf16 on the GPU's exact route, in-process and as a started server."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
import torch

from draftlab.api import SpeculativeDecoder
from draftlab.contenders.draftlab_serve import SERVED_NAME, DraftlabServer, ServeConfig
from draftlab.errors import DraftlabError
from draftlab.serving.build import ServeSettings, build_served
from draftlab.serving.scheduler import LoadK
from draftlab.drafters.heads import save_heads_draft
from tests.conftest import shape_model_dir, tiny_model_dir
from tests.test_heads import random_heads
from tests.serve_jobs import serve_jobs

TOKENS = 24
GPU = os.environ.get("DRAFTLAB_TEST_DEVICE", "cuda")
on_gpu = [pytest.mark.gpu, pytest.mark.skipif(GPU == "cuda" and not torch.cuda.is_available(),
                                              reason="no CUDA device here: run `pytest -m gpu` on a machine with one")]


def repeating_prompts(vocab: int, count: int) -> list[list[int]]:
    """Prompts with repeats in them (so n-gram drafts are accepted), of different lengths."""
    generator = torch.Generator().manual_seed(7)
    prompts = []
    for i in range(count):
        motif = torch.randint(1, vocab - 1, (3 + i,), generator=generator).tolist()
        prompts.append(motif * (2 + i % 3) + motif[:2])
    return prompts


def check_served_as_alone(target: str, device: str, vocab: int) -> None:
    """Every request alone equals `draftlab generate`'s plain decoding; request 0 with 1 and 3 others (joining
    50 ms apart, of other lengths) still does; drafts were made and accepted."""
    prompts = repeating_prompts(vocab, 4)
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1, device=device)
    expected = [plain.generate(ids, max_new_tokens=TOKENS, temperature=0).token_ids for ids in prompts]
    served = build_served(ServeSettings(target, "ngram", LoadK.parse("1:4,2-3:2,4:1"), slots=3, context=256,
                                        backend="auto", device=device))
    served.scheduler.start()
    try:
        assert [serve_jobs(served, [(ids, TOKENS, 0)])[0] for ids in prompts] == expected
        for others in (1, 3):  # 3: one of them waits for a free slot
            answers = serve_jobs(served, [(prompts[0], TOKENS, 0)] +
                                 [(prompts[i], 6 + 4 * i, 0.05) for i in range(1, others + 1)])
            assert answers[0] == expected[0]
            assert all(answers[i] == expected[i][:len(answers[i])] for i in range(1, others + 1))
        assert served.metrics.drafted > 0 and served.metrics.accepted > 0
    finally:
        served.scheduler.stop()


def test_each_request_on_torch_decodes_as_alone_whatever_is_in_flight(tmp_path):
    check_served_as_alone(str(tiny_model_dir(tmp_path / "tiny")), "cpu", 64)


def test_the_server_loads_and_times_its_rows_on_a_thread_that_ends(tmp_path, monkeypatch):
    """Loading and `--k auto`'s startup timing run on a thread that ends before the server steps: no OpenMP team of
    the caller's (the server's main thread, which runs the HTTP loop) is left beside the scheduler's decodes."""
    import threading

    from draftlab.serving import build

    seen = []

    def timed(batch, vocab_size):
        seen.append(threading.current_thread())
        return block_cost(batch, vocab_size, rows=(1, 2))
    block_cost = build.block_cost
    monkeypatch.setattr(build, "block_cost", timed)
    served = build_served(ServeSettings(str(tiny_model_dir(tmp_path / "tiny")), "ngram", None, slots=2, context=64,
                                        backend="auto"))
    assert served.scheduler.engine.chooser.cost.points[0][0] == 1
    assert len(seen) == 1 and seen[0] is not threading.current_thread() and not seen[0].is_alive()


@pytest.mark.parametrize("shape", ["", "tree:2x2:"])
def test_decoder_heads_and_their_trees_serve_on_torch_each_request_as_alone(tmp_path, tiny_target, shape):
    """Decoder heads (reading the final hidden states) and a tree of them, served on torch with 3 slots: every
    request, alone and 3 at once (joining apart), decodes as `draftlab generate`'s plain decoding alone."""
    target = str(tiny_model_dir(tmp_path / "tiny"))  # tiny_target's weights, with a tokenizer
    heads = save_heads_draft(random_heads(tiny_target, torch.arange(64)), tmp_path / "heads", "tiny")
    prompts = repeating_prompts(64, 3)
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    expected = [plain.generate(ids, max_new_tokens=TOKENS, temperature=0).token_ids for ids in prompts]
    served = build_served(ServeSettings(target, f"{shape}model:{heads}", LoadK.parse("1:3,2-3:2"), slots=3,
                                        context=256, backend="auto"))
    served.scheduler.start()
    try:
        alone = [serve_jobs(served, [(ids, TOKENS, 0)])[0] for ids in prompts]
        together = serve_jobs(served, [(ids, TOKENS, 0.02 * i) for i, ids in enumerate(prompts)])
    finally:
        served.scheduler.stop()
    assert alone == expected and together == expected and served.metrics.drafted > 0


def test_a_cut_vocabulary_draft_serves_on_torch_each_request_as_alone(tmp_path):
    """`model:DIR,head=N` (a draft of the N lowest ids, its rows mapped to token ids) served with 3 slots: each slot's
    draft backend scores its N rows only, and every request, alone and 3 at once, decodes as plain decoding alone."""
    target = str(tiny_model_dir(tmp_path / "tiny"))
    prompts = [[i % 30 + 1 for i in ids] for ids in repeating_prompts(64, 3)]  # ids the cut draft holds
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    expected = [plain.generate(ids, max_new_tokens=TOKENS, temperature=0).token_ids for ids in prompts]
    served = build_served(ServeSettings(target, f"model:{target},head=40", LoadK.parse("1:3,2-3:2"), slots=3,
                                        context=256, backend="auto"))
    streams = served.scheduler.engine.drafter.streams
    assert streams.score({2: [1]})[2].shape[-1] == len(served.scheduler.engine.drafter.like.vocab_map)
    streams.rollback(2, 0)
    served.scheduler.start()
    try:
        alone = [serve_jobs(served, [(ids, TOKENS, 0)])[0] for ids in prompts]
        together = serve_jobs(served, [(ids, TOKENS, 0.02 * i) for i, ids in enumerate(prompts)])
    finally:
        served.scheduler.stop()
    assert alone == expected and together == expected and served.metrics.drafted > 0


def test_torch_flags_are_refused_on_llama_cpp_and_repack_on_torch():
    with pytest.raises(DraftlabError, match="torch backend"):
        ServeSettings("smollm2-135m@Q4_0_PURE", device="cuda")
    with pytest.raises(DraftlabError, match="repack is llama.cpp's"):
        ServeSettings("smollm2-135m", numerics="repack", backend="auto")


@pytest.fixture(scope="module")
def gpu_target(tmp_path_factory) -> str:
    return str(shape_model_dir(tmp_path_factory.mktemp("qwen-shape"), "qwen2.5-1.5b", 4, torch.bfloat16, GPU))


@pytest.mark.parametrize("case", [pytest.param("in-process", marks=on_gpu)])
def test_each_request_on_the_gpu_decodes_as_alone_whatever_is_in_flight(gpu_target, case):
    check_served_as_alone(gpu_target, GPU, 151936)


@pytest.mark.parametrize("case", [pytest.param("server", marks=on_gpu)])
def test_a_started_server_on_the_gpu_answers_as_draftlab_generate(gpu_target, tmp_path, case):
    prompts = repeating_prompts(151936, 2)
    plain = SpeculativeDecoder.from_names(gpu_target, drafter="none", k=1, device=GPU)
    config = ServeConfig(gpu_target, "ngram", "1:3,2:2", slots=2, context=256, backend="auto", device=GPU)
    with DraftlabServer(config, tmp_path) as server:
        for ids in prompts:
            body = json.dumps({"model": SERVED_NAME, "prompt": ids, "max_tokens": TOKENS, "temperature": 0,
                               "return_token_ids": True}).encode()
            request = urllib.request.Request(f"http://127.0.0.1:{server.port}/v1/completions", data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                answer = json.loads(response.read())
            expected = plain.generate(ids, max_new_tokens=TOKENS, temperature=0).token_ids
            assert answer["choices"][0]["token_ids"] == expected
