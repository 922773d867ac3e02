"""A `draftlab serve` from its settings: the target on llama.cpp's exact kernels (its GGUF) or on the torch backend's
exact route (CPU or CUDA) and the drafter, composed as `draftlab generate` composes them (`draftlab.compose`), a
sequence per slot scored in one call, one engine stepping every request in flight, the scheduler and the app."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, TypeVar

from draftlab.api import eos_ids
from draftlab.backends import LLAMACPP, engine_of_backend
from draftlab.backends.sequences import Sequences
from draftlab.compose import TargetSpec, load_target, served_drafter, slot_sequences
from draftlab.decoding.kchoice import AutoK, BlockCost, LoadK, LoadThenAuto, StepK
from draftlab.decoding.step import Block
from draftlab.drafters.kinds import learns_across_requests, with_suffix_store
from draftlab.engine import SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.perf.calibrate import Profile, route_of
from draftlab.serving.app import Served
from draftlab.serving.metrics import ServeMetrics
from draftlab.serving.protocol import ApiError
from draftlab.serving.scheduler import Scheduler

T = TypeVar("T")


@dataclass(frozen=True)
class ServeSettings:
    """What `draftlab serve` is started with."""

    target: str  # a short name, a GGUF file (a short name's pure Q4_0: NAME@Q4_0_PURE)
    drafter: str = "none"
    ks: LoadK | None = LoadK.fixed(0)  # K per requests in flight (0: plain decoding); None: `--k auto`
    k_max: int = 8  # `--k auto`'s deepest draft
    slots: int = 4  # requests decoded at once
    max_waiting: int = 64  # requests queued beyond the slots before a 429
    context: int | None = None  # KV cells per slot (None: the model's, at most 8192)
    numerics: str = "exact"  # llama.cpp: exact (rows as alone) or repack (its own kernels: rows round apart);
    # torch: exact (the exact route measured fastest here) or a route label ("bf16 exact-linear/16")
    name: str = ""  # the model's name in the API (default: the target as given)
    api_key: str = ""
    suffix_cache: str = ""  # a directory suffix decoding's cache is kept in across restarts
    threads: int | None = None  # llama.cpp's threads for the batch (None: the cores this process may use)
    backend: str = LLAMACPP.backend  # llamacpp, or a torch backend (auto, fast, hf)
    device: str = "cpu"  # torch backends: cpu or cuda
    dtype: str = "auto"  # torch backends: the weights' dtype (auto: the exact route measured fastest here)
    prompt_cache: bool = True  # a retired request's cells stay in its slot for a prompt that starts with its tokens
    cost_profile: str = ""  # a profile timed on this host (`draftlab calibrate`, a study's profile.json) whose target
    # block costs `--k auto` weighs a step's rows by ('': timed at startup)

    def __post_init__(self) -> None:
        if self.slots < 1 or self.max_waiting < 0:
            raise DraftlabError("draftlab serve needs --max-in-flight >= 1 and --max-queue >= 0")
        if self.on_llamacpp and self.numerics not in ("exact", "repack"):
            raise DraftlabError(f"draftlab serve's --numerics on llama.cpp is exact or repack, not {self.numerics!r}")
        if not self.on_llamacpp and self.numerics == "repack":
            raise DraftlabError("--numerics repack is llama.cpp's; the torch backend takes exact or a route label")
        if self.cost_profile and self.ks is not None and not self.ks.has_auto:
            raise DraftlabError("--cost-profile prices the rows --k auto chooses; a fixed --k or --k-per-load without "
                                "auto has none to price")
        if self.on_llamacpp and (self.device != "cpu" or self.dtype != "auto"):
            raise DraftlabError("llama.cpp serves the GGUF's own types on the CPU: --device and --dtype are the "
                                "torch backend's (add --backend auto)")

    @property
    def on_llamacpp(self) -> bool:
        """The target's GGUF in llama.cpp (else torch)."""
        return engine_of_backend(self.backend).runs_gguf

    @property
    def drafter_spec(self) -> str:
        """The drafter's spec, with the suffix cache's directory where one is given."""
        if not self.suffix_cache:
            return self.drafter
        if not learns_across_requests(self.drafter):
            raise DraftlabError("--suffix-cache keeps suffix decoding's cache; use it with --drafter suffix")
        return with_suffix_store(self.drafter, self.suffix_cache)


def build_served(settings: ServeSettings) -> Served:
    """Load the target and build everything the app serves (the scheduler not yet started), on a thread that ends
    (`apart`)."""
    return apart(lambda: _build(settings))


def _build(settings: ServeSettings) -> Served:
    target = load_target(TargetSpec(settings.target, settings.backend, settings.device, settings.dtype,
                                    settings.numerics))
    loaded, batch = target.loaded, slot_sequences(target, settings.slots, settings.context, settings.threads)
    draft = served_drafter(settings.drafter_spec, target, settings.slots, settings.context, settings.threads)
    chooser = choose_ks(settings.ks, lambda: auto_k(target_costs(batch, loaded.vocab_size, settings.cost_profile),
                                                    batch, draft.streams, loaded.vocab_size, settings.k_max))
    metrics = ServeMetrics(k_rows=settings.ks.text() if settings.ks else "auto",
                           draft_passes=draft_passes(draft.streams))
    context = min(loaded.context_length, batch.n_ctx)
    tokenizer = loaded.tokenizer

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    engine = SpeculativeEngine(batch.view(0), draft.drafter, context_length=context, decode=decode, sequences=batch,
                               chooser=chooser)
    scheduler = Scheduler(engine, settings.slots, settings.max_waiting, metrics, settings.prompt_cache)
    return Served(model=settings.name or settings.target, encode_text=lambda text: _encode(tokenizer, text),
                  encode_chat=lambda messages: _chat(tokenizer, messages), decode=decode,
                  stream_decoder=stream_decoder(tokenizer),
                  vocab_size=loaded.vocab_size, context_length=context, eos_ids=eos_ids(loaded),
                  scheduler=scheduler, metrics=metrics, api_key=settings.api_key, numerics=batch.view(0).numerics)


def draft_passes(streams: Sequences | None) -> Callable[[], int] | None:
    """How /metrics reads a served draft model's passes over its weights (None: no draft model)."""
    return None if streams is None else lambda: streams.decodes


def choose_ks(ks: LoadK | None, auto: Callable[[], AutoK]) -> StepK:
    """The step's K: `--k auto` (None), `--k-per-load` rows, or rows some of whose K are auto."""
    if ks is None:
        return auto()
    return LoadThenAuto(ks, auto()) if ks.has_auto else ks


def auto_k(cost: BlockCost, batch: Sequences, draft: Sequences | None, vocab_size: int, k_max: int) -> AutoK:
    """`--k auto` over the target's cost curve, and a draft model's (its streams', timed at startup) where it runs
    one (other drafters' cost as the steps time them, `AutoK.timed`)."""
    if draft is None:
        return AutoK(cost, batch.passes, k_max)
    return AutoK(cost, batch.passes, k_max, draft=block_cost(draft, vocab_size), draft_passes=draft.passes,
                 calibrated=True)


def target_costs(batch: Sequences, vocab_size: int, profile: str) -> BlockCost:
    """The target's cost curve: timed at startup, or read from a profile timed on the same numerics (a one-line
    error where its numerics are not the server's: another weight type, kernels or route costs otherwise)."""
    if not profile:
        return block_cost(batch, vocab_size)
    read = Profile.load(profile)
    numerics = batch.view(0).numerics
    if route_of(read.numerics) != route_of(numerics):
        raise DraftlabError(f"{profile} timed {read.numerics or 'a target of unknown numerics'}, not this server's "
                            f"{numerics}: leave --cost-profile out to time the blocks at startup")
    return BlockCost(tuple(sorted(read.target.score_s.items())))


def apart(work: Callable[[], T]) -> T:
    """`work`'s result, computed on a thread that ends with it. llama.cpp's CPU backend and torch run their parallel
    work on an OpenMP team of the calling thread, and a team left beside a long-lived thread (the server's main
    thread, which then runs the HTTP loop) slows every later decode of the scheduler's thread (2 cores: SmolLM2's
    steps 7.2-9.1 ms, 9.1-10.6 ms after `--k auto`'s startup timing ran on the main thread; with an EAGLE-3 draft
    loaded there, plain decoding 61.6 tok/s, 78.2 loaded apart); a thread that ends takes its team with it."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="draftlab-startup") as pool:
        return pool.submit(work).result()


def block_cost(batch: Sequences, vocab_size: int, rows: tuple[int, ...] = (*range(1, 10), 12, 16, 24, 32),
               repeats: int = 3) -> BlockCost:
    """The target's seconds per pass of 1-32 rows on this host, timed at startup in sequence 0 (then emptied): the
    cost curve `--k auto` weighs each step's rows by (the fastest of `repeats` each). Every row count a request's
    block takes alone (1-9 at `--k-max` 8) is timed: a kernel's cost need not be linear between powers of two."""
    tokens = [i % vocab_size for i in range(1, max(rows) + 1)]
    batch.prefill(0, tokens[:1], final=True)  # a first cell, as a prompt leaves one
    points = []
    for n in rows:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            batch.score_blocks({0: Block.chain(tokens[:n])})
            best = min(best, time.perf_counter() - started)
            batch.rollback(0, 1)
        points.append((n, best))
    batch.rollback(0, 0)
    return BlockCost(tuple(points))


def stream_decoder(tokenizer) -> Callable[[], Callable[[int], str | None]]:
    """A new incremental detokenizer per answer (`tokenizers`' DecodeStream on the fast tokenizer's backend): each
    token decoded once, a character whose bytes have not all come held back, the text `decode` gives whole."""
    from tokenizers.decoders import DecodeStream

    backend = tokenizer.backend_tokenizer

    def new() -> Callable[[int], str | None]:
        stream = DecodeStream(skip_special_tokens=True)
        return lambda token: stream.step(backend, token)
    return new


def _encode(tokenizer, text: str) -> list[int]:
    """A completion's prompt as the tokenizer encodes it (its own special tokens, as llama-server and vLLM add them)."""
    return list(tokenizer(text)["input_ids"])


def _chat(tokenizer, messages: tuple[dict, ...]) -> list[int]:
    """Chat turns through the model's own chat template, ready for the assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError("this model has no chat template; use /v1/completions")
    encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
