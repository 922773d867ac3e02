"""`draftlab serve` on the real SmolLM2 (pure Q4_0 on the exact kernels): each request in flight decodes bitwise as
it does alone, K changing with the load; then a started server driven by the official `openai` client (the README's
test command's smoke test of the engine), bad inputs, a full queue, a client that goes away, and SIGTERM with
requests in flight (the slow tier)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from draftlab.api import SpeculativeDecoder
from draftlab.contenders.draftlab_serve import SERVED_NAME, DraftlabServer, ServeConfig
from draftlab.engine import GenerationConfig
from draftlab.models import gguf_path
from draftlab.serving.build import ServeSettings, build_served
from draftlab.serving.scheduler import Job, LoadK
from tests.serve_jobs import TARGET, prompts, serve_jobs, target  # noqa: F401 (the fixtures)
from tests.required import OPENAI, module_or_skip
from tests.tiers import exhaustive

pytestmark = pytest.mark.integration
TOKENS = 40
KEY = "sk-draftlab-test"


@pytest.fixture(scope="module")
def plain(target, prompts):
    """draftlab generate's plain decoding of each prompt (the reference every answer must equal)."""
    decoder = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend="llamacpp")
    return [decoder.generate(ids, max_new_tokens=TOKENS, temperature=0).token_ids for ids in prompts]


@pytest.mark.slow
@pytest.mark.parametrize("drafter, ks", [("ngram", "1:4,2-3:2,4:0"), exhaustive("suffix", "1-2:6,3-4:3")])
def test_each_request_decodes_as_alone_whatever_is_in_flight(prompts, plain, drafter, ks):
    served = build_served(ServeSettings(TARGET, drafter, LoadK.parse(ks), slots=4, context=2048))
    served.scheduler.start()
    try:
        alone = [serve_jobs(served, [(ids, TOKENS, 0)])[0] for ids in prompts]
        assert alone == plain  # draftlab generate's plain decoding, token for token
        for others in (1, 3, 7):  # the same request with others of other lengths, joining mid-decode (7: queued)
            batch = [(prompts[0], TOKENS, 0)] + [(prompts[i], 8 + 4 * i, 0.05 * i) for i in range(1, others + 1)]
            answers = serve_jobs(served, batch)
            assert answers[0] == plain[0]
            assert all(answers[i] == plain[i][:len(answers[i])] for i in range(1, others + 1))
        assert served.metrics.drafted > 0 and served.metrics.accepted > 0
    finally:
        served.scheduler.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """Suffix decoding with `--k auto`, 4 slots, an API key: what the main job deploys."""
    config = ServeConfig(TARGET, "suffix", "auto", slots=4, context=2048, api_key=KEY)
    with DraftlabServer(config, tmp_path_factory.mktemp("serve")) as running:
        yield running


def post(server, path: str, body: bytes, timeout: float = 60, key: str = KEY) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metrics_text(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as response:
        return response.read().decode()


def test_the_openai_client_gets_completions_chats_and_streams(server, target, prompts, plain):
    openai = module_or_skip("openai", OPENAI, "the official openai client is not installed (pip install -e .[test])")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    for ids, expected in zip(prompts, plain):  # greedy over the API: draftlab generate's tokens
        answer = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=TOKENS, temperature=0,
                                           extra_body={"return_token_ids": True})
        assert answer.choices[0].token_ids == expected
        assert answer.usage.prompt_tokens == len(ids) and answer.usage.completion_tokens == len(expected)
    text = target.tokenizer.decode(plain[0], skip_special_tokens=True)
    streamed = client.completions.create(model=SERVED_NAME, prompt=prompts[0], max_tokens=TOKENS, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == TOKENS and chunks[-2].choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=12, temperature=0)
    parts = client.chat.completions.create(model=SERVED_NAME, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts) == chat.choices[0].message.content
    sampled = client.completions.create(model=SERVED_NAME, prompt="Once upon a time", max_tokens=16,
                                        temperature=0.8, top_p=0.9, seed=7)
    assert sampled.usage.completion_tokens == 16 and sampled.choices[0].finish_reason == "length"


def test_the_openai_client_with_4_in_flight_gets_each_answer_as_alone(server, prompts, plain):
    """4 requests at once through the official client: /metrics shows the 4 running together, and each answer is
    draftlab generate's plain decoding of its prompt alone."""
    openai = module_or_skip("openai", OPENAI, "the official openai client is not installed (pip install -e .[test])")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=KEY, max_retries=0)
    chosen = [i for i, ids in enumerate(plain) if len(ids) == TOKENS][:4]  # answers that run to max_tokens
    assert len(chosen) == 4
    with running_counts(server) as running, ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda i: client.completions.create(
            model=SERVED_NAME, prompt=prompts[i], max_tokens=TOKENS, temperature=0,
            extra_body={"return_token_ids": True}).choices[0].token_ids, chosen))
    assert answers == [plain[i] for i in chosen]
    assert max(running) == 4


def test_the_api_key_is_required(server):
    for path, body in (("/v1/models", None), ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')):
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=body,
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 401 and json.loads(refused.value.read())["error"]["code"] == 401
    assert post(server, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}', key="wrong")[0] == 401


@pytest.mark.slow
@pytest.mark.parametrize("body, status", [
    (b"{oops", 400), (b'{"model": "gpt-5", "prompt": "hi"}', 404), (b'{"prompt": "hi", "max_tokens": 0}', 400),
    (b'{"prompt": "hi", "max_tokens": -1}', 400), (b'{"prompt": "hi", "max_tokens": 100000000}', 400),
    (json.dumps({"prompt": [1] * 2100}).encode(), 400), (b'{"prompt": "hi", "n": 2}', 400),
    (b'{"prompt": "hi", "logprobs": 3}', 400), (b'{"prompt": [99999999]}', 400),
    (b'{"prompt": "hi", "top_k": "five"}', 400), (b'{"prompt": "hi", "repetition_penalty": 1.3}', 400),
    (b'{"messages": [{"role": "user", "content": "hi"}], "min_p": 2}', 400),
    (b'{"prompt": "hi", "speculative.n_max": -1}', 400), (b'{"prompt": "hi", "speculative.n_max": 1.5}', 400),
])
def test_each_bad_input_is_one_json_error_and_the_next_request_is_served(server, body, status):
    code, answer = post(server, "/v1/completions", body)
    assert code == status and answer["error"]["message"] and answer["error"]["code"] == status
    code, answer = post(server, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
    assert code == 200 and answer["usage"]["completion_tokens"] == 2


def test_top_k_and_min_p_are_used_and_ignore_eos_runs_on(server, prompts, plain):
    """top_k 1 (or min_p 1) at temperature 1 leaves one token a step, the likeliest: greedy's tokens; ignore_eos
    decodes past the end of an answer that stops early."""
    for extra in ({"top_k": 1}, {"min_p": 1.0}):
        code, answer = post(server, "/v1/completions", json.dumps(
            {"prompt": prompts[0], "max_tokens": TOKENS, "temperature": 1.0, "seed": 5, "return_token_ids": True,
             **extra}).encode())
        assert code == 200 and answer["choices"][0]["token_ids"] == plain[0]
    chat = {"messages": [{"role": "user", "content": "Is water wet? Answer yes or no."}], "max_tokens": TOKENS,
            "temperature": 0, "return_token_ids": True}
    code, short = post(server, "/v1/chat/completions", json.dumps(chat).encode())
    assert code == 200 and short["choices"][0]["finish_reason"] == "stop"
    assert short["usage"]["completion_tokens"] < TOKENS  # the answer ends at its end-of-sequence token
    code, longer = post(server, "/v1/chat/completions", json.dumps({**chat, "ignore_eos": True}).encode())
    ids = short["choices"][0]["token_ids"]
    assert code == 200 and longer["choices"][0]["token_ids"][:len(ids)] == ids
    assert longer["usage"]["completion_tokens"] == TOKENS and longer["choices"][0]["finish_reason"] == "length"


def test_a_requests_speculative_n_max_caps_its_drafts_and_keeps_its_tokens(server, prompts, plain):
    """`speculative.n_max` (llama-server's per-request cap, what a study's cells of one drafter at several K send to
    one server): at most that many tokens drafted a step, 0 none; the tokens are plain decoding's at every cap."""
    from draftlab.contenders.draftlab_serve import DraftlabServeRun
    from draftlab.measure import RunSettings

    settings = RunSettings(max_new_tokens=TOKENS, temperature=0.0)
    seen = {}
    for cap in (None, 1, 0):  # uncapped first: the suffix cache then holds this answer, and drafts deep
        result = DraftlabServeRun(server, 2048, False, None, max_draft=cap).run(prompts[1], settings)
        assert result.token_ids == plain[1], cap
        seen[cap] = result.stats.drafted, result.stats.steps
    assert seen[None][0] > seen[None][1]  # more than one token a step, uncapped
    assert seen[1][0] <= seen[1][1] and seen[0][0] == 0 and seen[0][1] == TOKENS


def test_a_20_mb_body_sent_chunked_is_refused_as_it_arrives(server):
    import http.client

    def chunks():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"a" * (1 << 20)
        yield b'"}'

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    began = time.perf_counter()
    try:
        connection.request("POST", "/v1/completions", body=chunks(), encode_chunked=True,  # no Content-Length
                           headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server answered and closed before the whole body was sent
    response = connection.getresponse()
    body = json.loads(response.read())
    assert response.status == 413 and body["error"]["code"] == 413
    assert time.perf_counter() - began < 5.0  # refused as it arrives (0.0 s here), not read whole (19 s at 0.39.0)
    code, answer = post(server, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
    assert code == 200


@pytest.mark.slow
def test_a_full_queue_answers_429_and_a_client_gone_frees_its_slot(tmp_path, prompts):
    with DraftlabServer(ServeConfig(TARGET, "none", "1:0", slots=1, context=2048, queue=1), tmp_path) as server:
        gone = urllib.request.urlopen(urllib.request.Request(  # a stream its client drops after the first event
            f"http://127.0.0.1:{server.port}/v1/completions", data=json.dumps(
                {"prompt": prompts[1], "max_tokens": 1500, "stream": True}).encode(),
            headers={"Content-Type": "application/json"}), timeout=60)
        assert gone.readline().startswith(b"data: ")
        gone.close()
        deadline = time.monotonic() + 30
        while 'outcome="cancelled"} 1' not in metrics_text(server) and time.monotonic() < deadline:
            time.sleep(0.1)  # its slot is freed at the step after the server sees it gone
        seeded = json.dumps({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.8, "seed": 7}).encode()
        assert post(server, "/v1/completions", seeded)[1]["choices"] == post(server, "/v1/completions", seeded)[1][
            "choices"]  # a seed repeats a sampled answer where the drafts repeat (here: plain decoding)
        body = json.dumps({"prompt": prompts[0], "max_tokens": 300}).encode()
        with ThreadPoolExecutor(4) as pool:
            codes = [f.result()[0] for f in [pool.submit(post, server, "/v1/completions", body, 300)
                                              for _ in range(4)]]
        assert sorted(codes) == [200, 200, 429, 429]  # one in flight, one waiting, the rest refused
        metrics = metrics_text(server)
        assert 'outcome="cancelled"} 1' in metrics and 'outcome="rejected"} 2' in metrics


@pytest.mark.slow
def test_the_suffix_cache_survives_a_restart_and_still_learns(tmp_path, prompts, plain):
    """--suffix-cache DIR: an answer served before a restart is drafted from the cache after it (more drafts
    accepted than the first time), and an answer served after the restart is kept for the next; greedy answers stay
    draftlab generate's."""
    cache = tmp_path / "suffix-cache"

    def serve_once(index: int) -> dict:
        config = ServeConfig(TARGET, "suffix", "auto", slots=1, context=2048, suffix_cache=str(cache))
        with DraftlabServer(config, tmp_path) as running:
            code, answer = post(running, "/v1/completions", json.dumps(
                {"prompt": prompts[index], "max_tokens": TOKENS, "temperature": 0, "return_token_ids": True}).encode(),
                key="")
        assert code == 200 and answer["choices"][0]["token_ids"] == plain[index]
        return answer["draftlab"]

    first_a = serve_once(0)
    again_a = serve_once(0)  # a new server on the same cache: it knows the answer
    assert again_a["accepted"] > first_a["accepted"] and again_a["steps"] < first_a["steps"]
    first_b = serve_once(3)
    again_b = serve_once(3)  # learnt after the first restart, kept for the next
    assert again_b["accepted"] > first_b["accepted"]


@contextmanager
def running_counts(server):
    """`draftlab:num_requests_running` read from /metrics every 5 ms while the block runs: the list of readings."""
    running, done = [], threading.Event()

    def watch() -> None:
        while not done.is_set():
            running.append(gauge(metrics_text(server), "num_requests_running"))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        yield running
    finally:
        done.set()
        watcher.join()


def gauge(text: str, name: str) -> float:
    """A gauge's value in a /metrics page."""
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith(f"draftlab:{name} ")))


@pytest.mark.slow
def test_sigterm_drains_what_is_in_flight(tmp_path, prompts):
    """SIGTERM while /metrics shows two requests decoding and one waiting: each is answered whole, then the process
    exits (status 0, or -SIGTERM: uvicorn ends by the signal it drained for) within the drain time."""
    server = DraftlabServer(ServeConfig(TARGET, "ngram", "1:3", slots=2, context=2048), tmp_path)
    server.start()
    try:
        body = json.dumps({"prompt": prompts[2], "max_tokens": 400, "temperature": 0, "ignore_eos": True}).encode()
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(post, server, "/v1/completions", body, 120) for _ in range(3)]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                page = metrics_text(server)
                if gauge(page, "num_requests_running") == 2 and gauge(page, "num_requests_waiting") == 1:
                    break
                time.sleep(0.02)
            else:
                pytest.fail("the three requests were never two running and one waiting at once")
            os.kill(server.process.pid, signal.SIGTERM)
            signalled = time.monotonic()
            answers = [future.result(timeout=120) for future in futures]
        assert [code for code, _ in answers] == [200, 200, 200]
        assert all(answer["usage"]["completion_tokens"] == 400 for _, answer in answers)  # each whole
        assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert time.monotonic() - signalled < 120  # GRACE_S, the drain time
    finally:
        server.stop()


@pytest.mark.slow
def test_a_type_loaded_without_repack_prefills_on_its_twin_and_decodes_as_alone(prompts):
    """A file with a type whose repacked kernels round rows apart (IQ4_NL; K-quants load repacked since 0.35.0) loads
    without repack and prefills each request on its repacked twin, whose slots are copied into the server's (the same
    layout of streams): 4 requests at once equal `draftlab generate`."""
    target = "smollm2-135m@IQ4_NL"
    decoder = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend="llamacpp")
    assert not decoder.target.model.repack  # the twin's path
    plain_k = [decoder.generate(ids, max_new_tokens=24, temperature=0).token_ids for ids in prompts[:4]]
    served = build_served(ServeSettings(target, "ngram", LoadK.parse("1:3,2-4:2"), slots=4, context=2048))
    served.scheduler.start()
    try:
        assert serve_jobs(served, [(ids, 24, 0.0) for ids in prompts[:4]]) == plain_k
    finally:
        served.scheduler.stop()
