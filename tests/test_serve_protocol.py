"""`draftlab serve`'s requests, answers and K policy, without a model: every bad field is one clear error."""

from __future__ import annotations

import json

import pytest

from draftlab.errors import DraftlabError
from draftlab.serving.metrics import ServeMetrics
from draftlab.serving.protocol import ApiError, TextStream, parse_request
from draftlab.serving.scheduler import LoadK


def parse(body, chat: bool = False):
    return parse_request(json.dumps(body).encode() if not isinstance(body, bytes) else body, chat)


def test_a_completion_request_keeps_what_users_send():
    request = parse({"model": "m", "prompt": "Hi", "max_tokens": 5, "temperature": 0, "top_p": 0.9, "seed": 3,
                     "stop": "\n", "stream": True, "stream_options": {"include_usage": True}, "n": 1,
                     "logprobs": None})
    assert (request.prompt, request.max_tokens, request.temperature, request.top_p, request.seed) == ("Hi", 5, 0, 0.9, 3)
    assert request.stop == ("\n",) and request.stream and request.include_usage and not request.chat
    assert parse({"prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]  # token ids, one prompt in a list
    chat = parse({"messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                               {"role": "user", "content": "Hi"}], "max_completion_tokens": 4}, chat=True)
    assert chat.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi"})
    assert chat.max_tokens == 4


@pytest.mark.parametrize("body, chat, field", [
    (b"{not json", False, None),
    (b"[1, 2]", False, None),
    ({"prompt": ""}, False, "prompt"),
    ({"prompt": ["a", "b"]}, False, "prompt"),  # two prompts in one request
    ({"prompt": [1, -2]}, False, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, False, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, False, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, False, "max_tokens"),
    ({"prompt": "x", "n": 2}, False, "n"),
    ({"prompt": "x", "logprobs": 2}, False, "logprobs"),
    ({"prompt": "x", "echo": True}, False, "echo"),
    ({"prompt": "x", "presence_penalty": 0.5}, False, "presence_penalty"),
    ({"prompt": "x", "temperature": 3}, False, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, False, "temperature"),
    ({"prompt": "x", "stop": ["a", 1]}, False, "stop"),
    ({"prompt": "x", "stream": "yes"}, False, "stream"),
    ({"messages": []}, True, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, True, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, True, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, True, "tools"),
])
def test_each_bad_field_is_one_error_naming_it(body, chat, field):
    with pytest.raises(ApiError) as caught:
        parse(body, chat)
    error = caught.value.body()["error"]
    assert caught.value.status == 400 and error["param"] == field and error["message"] and "\n" not in error["message"]


def test_text_streams_whole_characters_and_stops_before_a_stop_string():
    pieces = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!"}
    stream = TextStream(lambda ids: "".join(pieces[i] for i in ids), ("wor",))
    out = "".join(stream.push([i]) for i in (1, 2, 3, 4)) + stream.close()
    assert out == "Hello " and stream.text == "Hello "
    texts = {(1,): "a", (1, 2): "a\ufffd", (1, 2, 3): "aé"}  # a character whose bytes came in two tokens
    stream = TextStream(lambda ids: texts[tuple(ids)], ())
    assert [stream.push([1]), stream.push([2]), stream.push([3]), stream.close()] == ["a", "", "é", ""]


def test_k_per_load_reads_the_studys_rows_and_refuses_gaps():
    ks = LoadK.parse("1-2:6,3-4:3,5-8:0")
    assert [ks.at(n) for n in (1, 2, 3, 4, 5, 8, 16)] == [6, 6, 3, 3, 0, 0, 0]
    assert ks.text() == "1-2:6,3-4:3,5-8:0" and LoadK.fixed(4).at(9) == 4
    for bad in ("2:4", "1:4,3:2", "1:-1", "1-x:4", "1:4,"):
        with pytest.raises(DraftlabError):
            LoadK.parse(bad)


def test_metrics_are_prometheus_text():
    metrics = ServeMetrics(k_rows="1:4")
    metrics.step(2, [4, 0], 6)
    metrics.tokens(4, 3, 0.02)
    metrics.finished("ok")
    text = metrics.text()
    assert 'draftlab:request_total{outcome="ok"} 1' in text
    assert "draftlab:spec_decode_num_accepted_tokens_total 2" in text and "draftlab:k_in_use 4" in text
    assert "draftlab:rows_per_step 6" in text and "draftlab:requests_drafting 1" in text
    metrics.idle()
    assert "draftlab:num_requests_running 0" in metrics.text() and "draftlab:k_in_use 0" in metrics.text()
    assert all(line.startswith("#") or len(line.split()) == 2 for line in text.splitlines())
