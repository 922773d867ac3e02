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

import pytest

from draftlab.api import SpeculativeDecoder, prompt_ids
from draftlab.contenders.draftlab_serve import SERVED_NAME, DraftlabServer, ServeConfig
from draftlab.engine import GenerationConfig
from draftlab.files.datasets import load_prompts
from draftlab.models import gguf_path, load_model
from draftlab.serving.build import ServeSettings, build_served
from draftlab.serving.scheduler import Job, LoadK
from tests.serve_jobs import serve_jobs
from tests.tiers import exhaustive

pytestmark = pytest.mark.integration
TARGET = "smollm2-135m@Q4_0_PURE"
TOKENS = 40


@pytest.fixture(scope="module")
def target():
    return load_model(TARGET, backend="llamacpp")


@pytest.fixture(scope="module")
def prompts(target):
    return [prompt_ids(target.tokenizer, p) for p in load_prompts("heldout", 8)]


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
    config = ServeConfig(TARGET, "suffix", "1-2:4,3:2", slots=2, context=2048)
    with DraftlabServer(config, tmp_path_factory.mktemp("serve")) as running:
        yield running


def post(server, path: str, body: bytes, timeout: float = 60) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metrics_text(server) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as response:
        return response.read().decode()


def test_the_openai_client_gets_completions_chats_and_streams(server, target, prompts, plain):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)
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


@pytest.mark.slow
@pytest.mark.parametrize("body, status", [
    (b"{oops", 400), (b'{"model": "gpt-5", "prompt": "hi"}', 404), (b'{"prompt": "hi", "max_tokens": 0}', 400),
    (b'{"prompt": "hi", "max_tokens": -1}', 400), (b'{"prompt": "hi", "max_tokens": 100000000}', 400),
    (json.dumps({"prompt": [1] * 2100}).encode(), 400), (b'{"prompt": "hi", "n": 2}', 400),
    (b'{"prompt": "hi", "logprobs": 3}', 400), (b'{"prompt": [99999999]}', 400),
])
def test_each_bad_input_is_one_json_error_and_the_next_request_is_served(server, body, status):
    code, answer = post(server, "/v1/completions", body)
    assert code == status and answer["error"]["message"] and answer["error"]["code"] == status
    code, answer = post(server, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
    assert code == 200 and answer["usage"]["completion_tokens"] == 2


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
def test_sigterm_drains_what_is_in_flight(tmp_path, prompts):
    server = DraftlabServer(ServeConfig(TARGET, "ngram", "1:3", slots=2, context=2048), tmp_path)
    server.start()
    try:
        body = json.dumps({"prompt": prompts[2], "max_tokens": 64, "temperature": 0}).encode()
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(post, server, "/v1/completions", body, 120) for _ in range(3)]
            time.sleep(1.0)
            os.kill(server.process.pid, signal.SIGTERM)
            results = []
            for future in futures:
                try:
                    results.append(future.result(timeout=120)[0])
                except OSError:  # refused: the server had stopped listening
                    results.append("refused")
        assert results == [200, 200, 200]  # two decoding and one waiting when the signal came: each answered
        assert server.process.wait(timeout=60) in (0, -signal.SIGTERM)  # uvicorn ends by the signal it drained for
    finally:
        server.stop()


@pytest.mark.slow
def test_the_deploy_lines_command_run_as_printed_serves_the_measured_tokens(tmp_path, prompts, plain):
    """A study's Deploy line for draftlab serve (`ServeConfig.command`), run by a shell with the venv's `draftlab`
    first on PATH, on another port: greedy answers equal draftlab's plain decoding."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from draftlab.contenders.served import die_with_parent, free_port

    command = ServeConfig(TARGET, "suffix", "1:6,2-64:3", slots=2, context=2048).command()
    port = free_port()
    words = shlex.split(command)
    words[words.index("--port") + 1] = str(port)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    with open(tmp_path / "serve.log", "wb") as log:
        process = subprocess.Popen(["bash", "-c", "exec " + shlex.join(words)], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert process.poll() is None, (tmp_path / "serve.log").read_text()
                time.sleep(0.3)
        for ids, expected in list(zip(prompts, plain))[:3]:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", headers={
                "Content-Type": "application/json"}, data=json.dumps({"prompt": ids, "max_tokens": TOKENS,
                                                                     "temperature": 0, "return_token_ids": True}).encode())
            with urllib.request.urlopen(request, timeout=120) as response:
                assert json.loads(response.read())["choices"][0]["token_ids"] == expected
    finally:
        process.terminate()
        process.wait(timeout=60)


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
