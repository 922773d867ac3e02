"""`draftlab serve`'s HTTP side: FastAPI routes over the scheduler (uvicorn serves them, as vLLM's and
llama-cpp-python's servers do).

`POST /v1/completions` and `/v1/chat/completions` (whole answers, or server-sent events with `stream: true`),
`GET /v1/models`, `/health`, `/metrics`. Each request becomes a scheduler `Job`; its tokens come back through an
asyncio queue fed from the scheduler's thread. Every error is one JSON body (`protocol.ApiError`); a full queue
answers 429; a client that goes away mid-answer frees its slot at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from draftlab.decoding.sampling import SamplingConfig
from draftlab.engine import GenerationConfig, GenerationResult
from draftlab.errors import DraftlabError
from draftlab.serving.metrics import ServeMetrics
from draftlab.serving.answers import FINISH, Answer, DraftlabStats, TextStream, answer, chunk, usage_chunk
from draftlab.serving.protocol import ApiError, Body, ChatBody, CompletionBody, api_error
from draftlab.serving.scheduler import Busy, Job, Scheduler

POLL_S = 0.5  # how often a whole answer's wait looks whether its client went away
MAX_BODY_BYTES = 4 << 20  # a request body past this is refused (413) as it arrives, before anything reads it whole
LOG = logging.getLogger("draftlab.serve")


@dataclass
class Served:
    """What the routes serve: the model's name, its tokenizer's two directions, its limits, the scheduler."""

    model: str
    encode_text: Callable[[str], list[int]]
    encode_chat: Callable[[tuple[dict, ...]], list[int]]
    decode: Callable[[list[int]], str]
    stream_decoder: Callable[[], Callable[[int], str | None]]  # a new incremental detokenizer, one per answer
    vocab_size: int
    context_length: int
    eos_ids: tuple[int, ...]
    scheduler: Scheduler
    metrics: ServeMetrics
    api_key: str = ""
    numerics: str = ""  # the target's numerics, for people (`Backend.numerics`)


def create_app(served: Served) -> FastAPI:
    """The ASGI app; the scheduler starts with it and drains when it shuts down."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        served.scheduler.start()
        try:
            yield
        finally:
            await asyncio.to_thread(served.scheduler.stop)

    app = FastAPI(title="draftlab serve", lifespan=lifespan, max_body_size=MAX_BODY_BYTES)

    def authorize(request: Request) -> None:
        _authorize(request, served)

    authorized = Depends(authorize)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[authorized])
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served.model, "object": "model", "created": 0,
                                            "owned_by": "draftlab", "max_model_len": served.context_length}]}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(served.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", dependencies=[authorized], response_model=Answer)
    async def completions(body: CompletionBody, request: Request):
        return await _complete(request, body, served)

    @app.post("/v1/chat/completions", dependencies=[authorized], response_model=Answer)
    async def chat_completions(body: ChatBody, request: Request):
        return await _complete(request, body, served)

    return app


async def _complete(request: Request, parsed: Body, served: Served):
    """Tokenize and queue a checked request; its whole answer or its stream."""
    if parsed.model and parsed.model != served.model:
        raise ApiError(f"the model {parsed.model!r} does not exist here; this server serves {served.model!r}",
                       status=404, kind="NotFoundError", param="model")
    prompt = _prompt_ids(parsed, served)
    config = _config(parsed, len(prompt), served)
    events: asyncio.Queue = asyncio.Queue()
    job = Job(prompt, config, _emitter(asyncio.get_running_loop(), events))
    try:
        served.scheduler.submit(job)
    except Busy as exc:
        served.metrics.finished("rejected")
        raise ApiError(str(exc), status=429, kind="rate_limit_error") from None
    except DraftlabError as exc:
        raise ApiError(str(exc), status=503, kind="service_unavailable") from None
    text = TextStream(served.stream_decoder(), config.stop_strings)
    if parsed.stream:
        return StreamingResponse(_stream(parsed, served, job, events, text, len(prompt)),
                                 media_type="text/event-stream")
    return await _whole(request, parsed, served, job, events, text, len(prompt))


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue) -> Callable[[str, object], None]:
    """A job's `emit`, called on the scheduler's thread: the event goes to the request's queue (dropped once the
    event loop closed, at the end of a shutdown that outlasted its grace)."""
    def emit(kind: str, value) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))
        except RuntimeError:
            pass
    return emit


def _authorize(request: Request, served: Served) -> None:
    if served.api_key and request.headers.get("authorization", "") != f"Bearer {served.api_key}":
        raise ApiError("a valid API key is needed (Authorization: Bearer KEY)", status=401,
                       kind="authentication_error")


def _prompt_ids(parsed: Body, served: Served) -> list[int]:
    """The prompt's token ids (the chat template for messages); ids outside the vocabulary refused."""
    try:
        if parsed.chat:
            return served.encode_chat(parsed.turns)
        if isinstance(parsed.prompt, str):
            return served.encode_text(parsed.prompt)
    except ApiError:
        raise
    except Exception as exc:  # the model's chat template or tokenizer refused this input
        what = "chat template" if parsed.chat else "tokenizer"
        raise ApiError(f"the model's {what} could not take this request: {type(exc).__name__}: {exc}",
                       param="messages" if parsed.chat else "prompt") from None
    outside = [t for t in parsed.prompt if t >= served.vocab_size]
    if outside:
        raise ApiError(f"prompt token id {outside[0]} is not in the vocabulary (0..{served.vocab_size - 1})",
                       param="prompt")
    return list(parsed.prompt)


def _config(parsed: Body, prompt_tokens: int, served: Served) -> GenerationConfig:
    """The engine's settings; a prompt and max_tokens past the context refused (as vLLM refuses them)."""
    room = served.context_length - prompt_tokens
    if room < 1:
        raise ApiError(f"the prompt has {prompt_tokens} tokens; this model's context holds {served.context_length}",
                       param="prompt")
    max_tokens = parsed.max_new or room
    if max_tokens > room:
        raise ApiError(f"the prompt ({prompt_tokens} tokens) and max_tokens ({max_tokens}) pass this model's context "
                       f"of {served.context_length} tokens; ask for at most {room}", param="max_tokens")
    seed = parsed.seed if parsed.seed is not None else random.randrange(2**31)
    sampling = SamplingConfig(parsed.temperature, parsed.top_k_or_off, parsed.top_p, parsed.min_p)
    return GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, seed=seed, stop_strings=parsed.stops,
                            eos_token_ids=() if parsed.ignore_eos else served.eos_ids,
                            max_draft=parsed.speculative_n_max)


async def _whole(request: Request, parsed: Body, served: Served, job: Job, events: asyncio.Queue,
                 text: TextStream, prompt_tokens: int) -> JSONResponse:
    """Wait for the answer (cancelling the job if the client goes away meanwhile)."""
    ids: list[int] = []
    try:
        while True:
            try:
                kind, value = await asyncio.wait_for(events.get(), POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled = True
                    return JSONResponse({}, status_code=499)
                continue
            if kind == "tokens":
                ids.extend(value)
            elif kind == "error":
                raise ApiError(value, status=500, kind="server_error")
            else:
                return JSONResponse(_whole_answer(parsed, served, text, ids, value, prompt_tokens))
    except asyncio.CancelledError:
        job.cancelled = True
        raise


def _whole_answer(parsed: Body, served: Served, text: TextStream, ids: list[int],
                  result: GenerationResult, prompt_tokens: int) -> dict:
    text.push(ids)
    stats = result.stats
    extra = DraftlabStats(drafted=stats.drafted, accepted=stats.accepted, steps=stats.steps,
                          prefill_s=round(stats.prefill_s, 6))
    return answer(parsed, served.model, text.text, ids, FINISH.get(stats.stop_reason, "stop"), prompt_tokens,
                  extra).body()


async def _stream(parsed: Body, served: Served, job: Job, events: asyncio.Queue, text: TextStream,
                  prompt_tokens: int) -> AsyncIterator[str]:
    """Server-sent events: a chunk per step that settles text, the finish, the usage if asked, then [DONE]; a client
    that goes away cancels the job."""
    count, first = 0, True
    try:
        while True:
            kind, value = await events.get()
            if kind == "tokens":
                count += len(value)
                delta = text.push(value)
                if delta or first or parsed.return_token_ids:  # token ids are never held back
                    yield _event(chunk(parsed, served.model, delta, None, value, first).body())
                    first = False
                continue
            if kind == "error":
                yield _event(ApiError(value, status=500, kind="server_error").body())
                break
            tail = text.close()
            yield _event(chunk(parsed, served.model, tail, FINISH.get(value.stats.stop_reason, "stop"), []).body())
            if parsed.include_usage:
                yield _event(usage_chunk(parsed, served.model, prompt_tokens, count).body())
            break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = True  # a no-op once it ended; else the client went away


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body the request models refuse: one line naming the field, in the OpenAI shape."""
    error = api_error(list(exc.errors()))
    return JSONResponse(error.body(), status_code=error.status)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    """Any other fault of a request: one JSON 500 (and a line in the log); the server goes on."""
    LOG.error("draftlab serve: %s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
    return JSONResponse(ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500, kind="server_error").body(),
                        status_code=500)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(ApiError(str(exc.detail), status=exc.status_code, kind=kind).body(),
                        status_code=exc.status_code)
