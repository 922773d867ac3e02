"""The OpenAI API's answers as `draftlab serve` gives them: pydantic models for whole answers and stream chunks (as
vLLM's and llama-server's), and the streamed text, each token decoded once.

vLLM's `token_ids` is given where the request asks for it (`return_token_ids`); every answer carries a `draftlab`
object with the request's drafted and accepted tokens, steps and prefill seconds.
"""

from __future__ import annotations

import time
from typing import Callable, Literal

from pydantic import BaseModel

from draftlab.serving.protocol import Body

FINISH = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length"}


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class DraftlabStats(BaseModel):
    """What speculation did for this request."""

    drafted: int
    accepted: int
    steps: int
    prefill_s: float


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class Choice(BaseModel):
    """One choice of a whole answer or of a stream chunk (text for completions, a message or delta for chats)."""

    index: int = 0
    text: str | None = None
    message: AssistantMessage | None = None
    delta: Delta | None = None
    finish_reason: str | None = None
    logprobs: None = None
    token_ids: list[int] | None = None


class Answer(BaseModel):
    """A whole answer (`text_completion` / `chat.completion`) or a stream chunk (`*.chunk`)."""

    id: str
    object: Literal["text_completion", "chat.completion", "chat.completion.chunk"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None
    draftlab: DraftlabStats | None = None

    def body(self) -> dict:
        """The JSON object sent: fields left unset are left out (a chunk's usage, a choice's token ids unasked)."""
        return self.model_dump(exclude_none=True) | {"choices": [_choice(c) for c in self.choices]}


def _choice(choice: Choice) -> dict:
    """A choice as sent: `logprobs` and `finish_reason` always there (null), the rest where set."""
    return choice.model_dump(exclude_none=True) | {"logprobs": None, "finish_reason": choice.finish_reason}


def answer(request: Body, model: str, text: str, token_ids: list[int], finish: str, prompt_tokens: int,
           stats: DraftlabStats) -> Answer:
    """The whole answer of a request."""
    choice = (Choice(message=AssistantMessage(content=text), finish_reason=finish) if request.chat else
              Choice(text=text, finish_reason=finish))
    if request.return_token_ids:
        choice.token_ids = token_ids
    return Answer(id=_id(request), object="chat.completion" if request.chat else "text_completion",
                  created=int(time.time()), model=model, choices=[choice],
                  usage=Usage.of(prompt_tokens, len(token_ids)), draftlab=stats)


def chunk(request: Body, model: str, text: str | None, finish: str | None, token_ids: list[int],
          first: bool = False) -> Answer:
    """One server-sent event's object of a stream."""
    if request.chat:
        delta = Delta(role="assistant", content=text or "") if first else Delta(content=text or None)
        choice = Choice(delta=delta, finish_reason=finish)
    else:
        choice = Choice(text=text or "", finish_reason=finish)
    if request.return_token_ids:
        choice.token_ids = token_ids
    return Answer(id=_id(request), object="chat.completion.chunk" if request.chat else "text_completion",
                  created=int(time.time()), model=model, choices=[choice])


def usage_chunk(request: Body, model: str, prompt_tokens: int, completion_tokens: int) -> Answer:
    """The last event with `stream_options.include_usage`: no choices, the usage."""
    return Answer(id=_id(request), object="chat.completion.chunk" if request.chat else "text_completion",
                  created=int(time.time()), model=model, choices=[], usage=Usage.of(prompt_tokens, completion_tokens))


def _id(request: Body) -> str:
    return ("chatcmpl-" if request.chat else "cmpl-") + request.request_id


class TextStream:
    """New tokens to new text, each token decoded once (`step`: an incremental detokenizer, `tokenizers`'
    `DecodeStream`, which holds back a character whose bytes have not all come): hands out what is settled, holding
    back anything that may begin a stop string; the text ends before the first stop string."""

    def __init__(self, step: Callable[[int], str | None], stops: tuple[str, ...]) -> None:
        self.step, self.stops = step, stops
        self.decoded = ""  # every token's text so far
        self.cut: int | None = None  # where the first stop string begins, once one has
        self.sent = 0  # characters handed out
        self.longest = max((len(s) for s in stops), default=0)

    def push(self, ids: list[int]) -> str:
        """The text the new tokens settle."""
        before = len(self.decoded)
        self.decoded += "".join(self.step(token) or "" for token in ids)
        if self.cut is None and self.stops:
            tail_from = max(0, before - self.longest + 1)  # a stop string ending in the new text starts here or later
            found = [i for i in (self.decoded.find(s, tail_from) for s in self.stops) if i >= 0]
            self.cut = min(found) if found else None
        settled = self.cut if self.cut is not None else len(self.decoded) - max(self.longest - 1, 0)
        return self._hand_out(settled)

    def close(self) -> str:
        """The rest of the text, at the end of the answer."""
        return self._hand_out(len(self.text))

    @property
    def text(self) -> str:
        """The answer's text so far, before any stop string."""
        return self.decoded if self.cut is None else self.decoded[:self.cut]

    def _hand_out(self, upto: int) -> str:
        upto = max(upto, self.sent)
        delta = self.text[self.sent:upto]
        self.sent = upto
        return delta
