"""The OpenAI API's requests as `draftlab serve` takes them: pydantic models FastAPI validates each body against (and
publishes at `/docs`), the subset vLLM and llama-server serve.

Every field of the OpenAI API and of vLLM's and llama-server's extras is honoured (`top_k`, `min_p`, `ignore_eos`
among them) or, where the server cannot honour it (`n` > 1, `logprobs`, penalties, tools, ...), refused with a 400
naming it, never ignored; a field no API it speaks defines is ignored with one line in the log, as vLLM does. A bad
body is one `ApiError` naming the field (`api_error`), in the OpenAI shape `{"error": {"message", "type", "param",
"code"}}`. Answers are built in `draftlab.serving.answers`.
"""

from __future__ import annotations

import json
import logging
import numbers
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, StrictBool, StrictStr,
                      ValidationError, field_validator, model_validator)

LOG = logging.getLogger("draftlab.serve")

# Fields that change what a model must do, which this server cannot do: refused with a 400 when set to anything but
# their defaults (the values given).
UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False), "best_of": (None, 1),
               "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None,),
               "response_format": (None, {"type": "text"}), "n": (None, 1),
               # vLLM's and llama-server's extras that change what is generated
               "repetition_penalty": (None, 1, 1.0), "length_penalty": (None, 1, 1.0), "min_tokens": (None, 0),
               "stop_token_ids": (None, []), "bad_words": (None, []), "allowed_token_ids": (None,),
               "use_beam_search": (None, False), "prompt_logprobs": (None,), "include_stop_str_in_output": (None, False),
               "skip_special_tokens": (None, True), "guided_json": (None,), "guided_regex": (None,),
               "guided_choice": (None,), "guided_grammar": (None,), "structured_outputs": (None,),
               "logits_processors": (None,), "truncate_prompt_tokens": (None,), "typical_p": (None, 1, 1.0),
               "repeat_penalty": (None, 1, 1.0), "mirostat": (None, 0), "grammar": (None, ""), "json_schema": (None,),
               "dry_multiplier": (None, 0, 0.0), "xtc_probability": (None, 0, 0.0), "n_probs": (None, 0)}
# What a server may leave aside without changing an answer: taken, not logged.
IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "cache_prompt", "request_id",
           "priority", "speculative.n_min", "speculative.p_min"}  # (llama-server's: a draft's floor, its confidence)


@dataclass
class ApiError(Exception):
    """One request's error: HTTP status and the OpenAI error body."""

    message: str
    status: int = 400
    kind: str = "invalid_request_error"
    param: str | None = None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def _number(value: Any) -> float:
    """A JSON number (not a string, not a bool)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ValueError(f"must be a number, got {json.dumps(value)}")
    return float(value)


def _integer(value: Any) -> int:
    """A JSON integer (not 2.5, not a string, not a bool)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"must be an integer, got {json.dumps(value)}")
    return int(value)


Number = Annotated[float, BeforeValidator(_number)]
Integer = Annotated[int, BeforeValidator(_integer)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class Message(BaseModel):
    """One chat turn (a `developer` turn is a system turn)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]

    def turn(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class Sampling(BaseModel):
    """The fields completions and chats share: length, sampling, stops, streaming; the refused and unknown ones."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = None
    max_tokens: Integer | None = Field(None, ge=1)
    temperature: Number = Field(1.0, ge=0.0, le=2.0)
    top_p: Number = Field(1.0, ge=1e-6, le=1.0)
    top_k: Integer = Field(0, ge=-1, description="-1 and 0: off")
    min_p: Number = Field(0.0, ge=0.0, le=1.0)
    seed: Integer | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = False
    ignore_eos: StrictBool = False
    # llama-server's per-request cap on the tokens drafted a step (0: this request decodes plainly); its answer is the
    # same at any value, only its speed changes
    speculative_n_max: Integer | None = Field(None, ge=0, alias="speculative.n_max")
    _request_id: str = PrivateAttr(default_factory=lambda: uuid.uuid4().hex[:24])

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop
        if stops is not None and (len(stops) > 4 or not all(stops)):
            raise ValueError("stop must be a non-empty string or a list of up to 4 of them")
        return stop

    @model_validator(mode="before")
    @classmethod
    def _refuse_and_log(cls, body):
        if isinstance(body, dict):
            for name, defaults in UNSUPPORTED.items():
                value = body.get(name)
                if name in body and not any(value == d and type(value) is type(d) or value is d for d in defaults):
                    raise _Refused(name, f"{name}={json.dumps(value)} is not supported by draftlab serve")
            known = {f.alias or name for name, f in cls.model_fields.items()}
            unknown = sorted(set(body) - known - set(UNSUPPORTED) - IGNORED)
            if unknown:
                LOG.warning("draftlab serve: ignoring unknown request field(s) %s", ", ".join(unknown))
        return body

    @property
    def chat(self) -> bool:
        return False

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def stops(self) -> tuple[str, ...]:
        return () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def top_k_or_off(self) -> int:
        """top_k with -1 (vLLM's off) as 0."""
        return max(self.top_k, 0)


class CompletionBody(Sampling):
    """`POST /v1/completions`: one prompt, text or token ids (a one-element list of either too)."""

    prompt: StrictStr | list[Integer] | list[StrictStr] | list[list[Integer]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, str) and prompt:
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            return prompt
        raise ValueError("prompt must be one non-empty string or one non-empty list of token ids (one prompt per "
                         "request)")

    @property
    def max_new(self) -> int | None:
        return self.max_tokens


class ChatBody(Sampling):
    """`POST /v1/chat/completions`: the turns, through the model's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Integer | None = Field(None, ge=1)

    @property
    def chat(self) -> bool:
        return True

    @property
    def turns(self) -> tuple[dict, ...]:
        return tuple(m.turn() for m in self.messages)

    @property
    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Body = CompletionBody | ChatBody


class _Refused(ValueError):
    """A field set to what the server cannot do (its name, for the error's `param`)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def parse_request(raw: bytes, chat: bool) -> Body:
    """A request body (what FastAPI does for the routes); an `ApiError` naming what is wrong."""
    model = ChatBody if chat else CompletionBody
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise api_error(exc.errors(include_url=False), ()) from None


def api_error(errors: list[dict], prefix: tuple = ("body",)) -> ApiError:
    """The first of pydantic's errors as one line naming its field (`prefix`: the location's head FastAPI adds)."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))[len(prefix):]
    refused = (first.get("ctx") or {}).get("error")
    if isinstance(refused, _Refused):
        return ApiError(str(refused), param=refused.name)
    if first.get("type") == "json_invalid":
        return ApiError(f"the request body is not JSON: {(first.get('ctx') or {}).get('error', first['msg'])}")
    if first.get("type") in ("model_type", "model_attributes_type", "dict_type") and not loc:
        return ApiError("the request body must be a JSON object")
    param = next((str(part) for part in loc if isinstance(part, str)), None)
    message = str(first.get("msg", "is not valid")).removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = "is required"
    return ApiError(f"{param}: {message}" if param else message, param=param)
