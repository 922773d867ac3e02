"""The OpenAI API's requests and answers as `draftlab serve` speaks them (the subset vLLM and llama-server serve).

A request body becomes a `CompletionRequest`, or one `ApiError` naming the field; the fields the server cannot
honour (`n` > 1, `logprobs`, penalties, tools, ...) are refused, never ignored. Answers are built here too: whole
ones, stream chunks, and the error body `{"error": {"message", "type", "code"}}`.
"""

from __future__ import annotations

import json
import numbers
import time
import uuid
from dataclasses import dataclass, field

# Fields that change what a model must do, which this server cannot do: refused with a 400 when set to anything but
# their default (the value given).
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None,),
               "response_format": (None, {"type": "text"}), "n": (None, 1)}
FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length"}


@dataclass
class ApiError(Exception):
    """One request's error: HTTP status and the OpenAI error body."""

    message: str
    status: int = 400
    kind: str = "invalid_request_error"
    param: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


@dataclass(frozen=True)
class CompletionRequest:
    """A completion or chat completion, checked."""

    chat: bool
    model: str
    prompt: str | list[int] | None  # text, or token ids used as they are (completions)
    messages: tuple[dict, ...]  # chat turns: role and content
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])


def parse_request(raw: bytes, chat: bool) -> CompletionRequest:
    """A request body; an `ApiError` naming what is wrong."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _refuse_unsupported(body)
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise ApiError("stream_options must be an object", param="stream_options")
    return CompletionRequest(
        chat=chat, model=_text(body, "model", required=False) or "",
        prompt=None if chat else _prompt(body), messages=_messages(body) if chat else (),
        max_tokens=_count(body, "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
        seed=_integer(body, "seed"), stop=_stop(body), stream=_flag(body, "stream"),
        include_usage=bool(stream_options.get("include_usage", False)),
        return_token_ids=_flag(body, "return_token_ids"))


def _refuse_unsupported(body: dict) -> None:
    for name, defaults in UNSUPPORTED.items():
        if name in body and not any(body[name] == d and type(body[name]) is type(d) or body[name] is d
                                    for d in defaults):
            raise ApiError(f"{name}={json.dumps(body[name])} is not supported by draftlab serve", param=name)


def _text(body: dict, name: str, required: bool = True) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise ApiError(f"{name} must be a string", param=name)
    return value


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("the prompt is empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return [int(t) for t in prompt]
    raise ApiError("prompt must be one non-empty string or one non-empty list of token ids (one prompt per request)",
                   param="prompt")


def _messages(body: dict) -> tuple[dict, ...]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    turns = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "user", "assistant", "developer"):
            raise ApiError("each message needs a role: system, developer, user or assistant", param="messages")
        turns.append({"role": "system" if message["role"] == "developer" else message["role"],
                      "content": _content(message.get("content"))})
    return tuple(turns)


def _content(content) -> str:
    """A message's text: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and
                                         isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise ApiError("message content must be text (a string or text parts)", param="messages")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _count(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise ApiError(f"{name} must be an integer >= 1, got {json.dumps(value)}", param=name)
    return int(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is not None and not _is_int(value):
        raise ApiError(f"{name} must be an integer", param=name)
    return None if value is None else int(value)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, numbers.Real) or isinstance(value, bool) or not low <= value <= high:
        raise ApiError(f"{name} must be a number in [{low:g}, {high:g}], got {json.dumps(value)}", param=name)
    return float(value)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError("stop must be a non-empty string or a list of up to 4 of them", param="stop")
    return tuple(stops)


class TextStream:
    """New tokens to new text: decodes the whole answer each time and hands out what is settled, holding back an
    unfinished character and anything that may begin a stop string; the text ends before the first stop string."""

    def __init__(self, decode, stops: tuple[str, ...]) -> None:
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.sent = 0  # characters handed out
        self.hold = max((len(s) for s in stops), default=1) - 1

    def push(self, ids: list[int]) -> str:
        """The text the new tokens settle."""
        self.ids.extend(ids)
        text = self._text()
        settled = len(text) - self.hold if self.hold else len(text)
        if text.endswith("\ufffd"):  # a character whose bytes have not all come
            settled = min(settled, len(text) - 1)
        return self._hand_out(text, settled)

    def close(self) -> str:
        """The rest of the text, at the end of the answer."""
        return self._hand_out(self._text(), None)

    @property
    def text(self) -> str:
        return self._text()

    def _text(self) -> str:
        text = self.decode(self.ids)
        cut = min((text.find(s) for s in self.stops if s in text), default=-1)
        return text[:cut] if cut >= 0 else text

    def _hand_out(self, text: str, upto: int | None) -> str:
        upto = len(text) if upto is None else max(upto, self.sent)
        delta = text[self.sent:upto]
        self.sent = upto
        return delta


def answer(request: CompletionRequest, model: str, text: str, token_ids: list[int], finish: str,
           prompt_tokens: int, extra: dict) -> dict:
    """The whole answer of a request."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
               "logprobs": None} if request.chat else
              {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
    if request.return_token_ids:
        choice["token_ids"] = token_ids
    return {"id": _id(request), "object": "chat.completion" if request.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage(prompt_tokens, len(token_ids)), "draftlab": extra}


def chunk(request: CompletionRequest, model: str, text: str | None, finish: str | None, token_ids: list[int],
          first: bool = False) -> dict:
    """One server-sent event's object of a stream (`text` None with only a usage to follow: no choice)."""
    if request.chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": None}
    if request.return_token_ids:
        choice["token_ids"] = token_ids
    return {"id": _id(request), "object": "chat.completion.chunk" if request.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(request: CompletionRequest, model: str, prompt_tokens: int, completion_tokens: int) -> dict:
    """The last event with `stream_options.include_usage`: no choices, the usage."""
    return {"id": _id(request), "object": "chat.completion.chunk" if request.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _id(request: CompletionRequest) -> str:
    return ("chatcmpl-" if request.chat else "cmpl-") + request.request_id
