"""`draftlab serve`'s requests, answers and K policy, without a model: every bad field is one clear error."""

from __future__ import annotations

import json

import pytest

from draftlab.errors import DraftlabError
from draftlab.serving.metrics import ServeMetrics
from draftlab.serving.answers import TextStream
from draftlab.serving.protocol import ApiError, parse_request
from draftlab.serving.scheduler import PASSED_OVER_AT_MOST, LoadK, next_prefill


def parse(body, chat: bool = False):
    return parse_request(json.dumps(body).encode() if not isinstance(body, bytes) else body, chat)


def test_a_completion_request_keeps_what_users_send():
    request = parse({"model": "m", "prompt": "Hi", "max_tokens": 5, "temperature": 0, "top_p": 0.9, "seed": 3,
                     "stop": "\n", "stream": True, "stream_options": {"include_usage": True}, "n": 1,
                     "logprobs": None})
    assert (request.prompt, request.max_new, request.temperature, request.top_p, request.seed) == ("Hi", 5, 0, 0.9, 3)
    assert request.stops == ("\n",) and request.stream and request.include_usage and not request.chat
    assert parse({"prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]  # token ids, one prompt in a list
    chat = parse({"messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                               {"role": "user", "content": "Hi"}], "max_completion_tokens": 4}, chat=True)
    assert chat.turns == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi"})
    assert chat.max_new == 4 and chat.chat


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
    ({"prompt": "x", "repetition_penalty": 1.1}, False, "repetition_penalty"),
    ({"prompt": "x", "min_tokens": 4}, False, "min_tokens"),
    ({"prompt": "x", "stop_token_ids": [2]}, False, "stop_token_ids"),
    ({"prompt": "x", "guided_json": {"type": "object"}}, False, "guided_json"),
    ({"prompt": "x", "top_k": 2.5}, False, "top_k"),
    ({"prompt": "x", "top_k": -2}, False, "top_k"),
    ({"prompt": "x", "min_p": 1.5}, False, "min_p"),
    ({"prompt": "x", "ignore_eos": "yes"}, False, "ignore_eos"),
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


def test_top_k_min_p_and_ignore_eos_are_honoured_and_unknown_fields_logged(caplog):
    request = parse({"prompt": "x", "top_k": 5, "min_p": 0.1, "ignore_eos": True, "repetition_penalty": 1.0,
                     "user": "me", "frobnicate": 3})
    assert (request.top_k_or_off, request.min_p, request.ignore_eos) == (5, 0.1, True)
    assert parse({"prompt": "x", "top_k": -1}).top_k_or_off == 0 and not parse({"prompt": "x"}).ignore_eos
    assert "frobnicate" in caplog.text and "user" not in caplog.text


def test_text_streams_each_token_once_and_stops_before_a_stop_string():
    pieces = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 5: "!"}
    decoded = []
    stream = TextStream(lambda token: decoded.append(token) or pieces[token], ("wor",))
    out = "".join(stream.push([i]) for i in (1, 2, 3, 4)) + stream.close()
    assert out == "Hello " and stream.text == "Hello " and decoded == [1, 2, 3, 4]  # each token decoded once
    stream = TextStream(lambda token: pieces[token], ("lo w", "!"))  # a stop string across tokens
    assert "".join(stream.push([i]) for i in (1, 2, 3, 4, 5)) + stream.close() == "Hel"
    held = {1: "a", 2: None, 3: "é"}  # a character whose bytes came in two tokens: the detokenizer holds it back
    stream = TextStream(lambda token: held[token], ())
    assert [stream.push([1]), stream.push([2]), stream.push([3]), stream.close()] == ["a", "", "é", ""]


def test_the_served_detokenizer_streams_what_the_tokenizer_decodes_whole():
    from draftlab.models import gguf_tokenizer
    from draftlab.serving.build import stream_decoder

    tokenizer = gguf_tokenizer("smollm2-135m")
    ids = tokenizer("naïve café 🍕 def f(x):\n    return x  <|im_end|> 中文")["input_ids"] + list(range(30000, 30200))
    stream = TextStream(stream_decoder(tokenizer)(), ())
    assert "".join(stream.push([i]) for i in ids) + stream.close() == tokenizer.decode(ids, skip_special_tokens=True)


def test_k_per_load_reads_the_studys_rows_and_refuses_gaps():
    ks = LoadK.parse("1-2:6,3-4:3,5-8:0")
    assert [ks.at(n) for n in (1, 2, 3, 4, 5, 8, 16)] == [6, 6, 3, 3, 0, 0, 0]
    assert ks.text() == "1-2:6,3-4:3,5-8:0" and LoadK.fixed(4).at(9) == 4
    for bad in ("2:4", "1:4,3:2", "1:-1", "1-x:4", "1:4,"):
        with pytest.raises(DraftlabError):
            LoadK.parse(bad)


def test_the_prompt_with_fewest_tokens_left_prefills_next_and_none_is_put_off_for_good():
    """A short prompt behind a long one's chunks goes first; a prompt passed over `PASSED_OVER_AT_MOST` times takes
    the next turn, however many shorter ones arrive."""
    assert next_prefill({0: (1500, 0), 2: (40, 0)}) == 2
    assert next_prefill({1: (300, 0), 0: (300, 0)}) == 1  # equals: the first admitted
    turns, passed = [], {0: 0}
    for arriving in range(1, 9):  # a short prompt arrives every turn; slot 0 holds a long one
        left = {0: (1500, passed[0]), arriving: (30, 0)}
        slot = next_prefill(left)
        turns.append(slot)
        passed[0] = 0 if slot == 0 else passed[0] + 1
    assert turns.count(0) == 2 and turns[PASSED_OVER_AT_MOST] == 0


def test_metrics_are_prometheus_text_with_vllms_names_and_histograms():
    from prometheus_client.parser import text_string_to_metric_families

    metrics = ServeMetrics(k_rows="1:4")
    metrics.step(2, [4, 0], 6)
    metrics.tokens(4, 3, 0.02)
    metrics.first_token(0.3)
    metrics.finished("ok", 1.5)
    text = metrics.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}  # parses as Prometheus text
    assert 'draftlab:request_total{outcome="ok"} 1.0' in text
    assert "draftlab:spec_decode_num_accepted_tokens_total 2.0" in text and "draftlab:k_in_use 4.0" in text
    assert "draftlab:rows_per_step 6.0" in text and "draftlab:requests_drafting 1.0" in text
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds",
                 "tokens_per_step"):
        assert families[f"draftlab:{name}"].type == "histogram"
    assert 'draftlab:e2e_request_latency_seconds_bucket{le="2.5"} 1.0' in text
    metrics.idle()
    assert "draftlab:num_requests_running 0.0" in metrics.text() and "draftlab:k_in_use 0.0" in metrics.text()
    assert ServeMetrics().text() != text  # each server its own registry


