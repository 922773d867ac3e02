"""What `draftlab serve` counts, and its `/metrics` page, through `prometheus_client` as vLLM exports them: vLLM's
names under the `draftlab:` prefix where vLLM has one (requests running and waiting, prompt and generated tokens,
drafted and accepted tokens, histograms of time to first token, time per output token and end-to-end latency),
draftlab's own beside them (tokens per step, rows per step, the K chosen, prompt chunks prefilled beside decoding, a
served draft model's passes over its weights against the steps' draft positions).

Each server has a registry of its own (no global state). The scheduler's thread and the app's write; the few
numbers read back in-process (by tests and benchmarks) are kept under a lock beside the Prometheus metrics.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

PREFIX = "draftlab:"
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
STEP_TOKEN_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)


class _Exported:
    """The Prometheus metrics of one server, in its own registry."""

    def __init__(self, k_policy: str, draft_passes: Callable[[], int] | None) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)

        def counter(name: str, text: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, text, labels, registry=registry)

        def gauge(name: str, text: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, text, labels, registry=registry)

        def histogram(name: str, text: str, buckets: tuple) -> Histogram:
            return Histogram(PREFIX + name, text, buckets=buckets, registry=registry)

        self.requests = counter("request", "Requests ended, by outcome (ok, cancelled, error, rejected).", ("outcome",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens prefilled.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the slots' cached prompts.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found cached in a slot (not prefilled again).")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.drafted = counter("spec_decode_num_draft_tokens", "Draft tokens scored.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.steps = counter("steps", "Draft-verify steps, one per request per engine step.")
        self.batches = counter("batches", "Engine steps (one batched target pass each).")
        self.rows = counter("rows", "Rows the target scored.")
        self.prefill_chunks = counter("prefill_chunks", "Prompt chunks prefilled.")
        self.prefill_beside = counter("prefill_chunks_beside_decoding",
                                      "Prompt chunks prefilled between the steps of requests decoding.")
        self.draft_positions = counter("draft_positions", "Each step's deepest draft, summed: one pass of a served "
                                       "draft model per position drafts every request in flight.")
        if draft_passes is not None:
            registry.register(_CounterRead(PREFIX + "draft_passes", "Passes of the served draft model over its "
                                           "weights (llama_decode calls on its context), catch-ups included.",
                                           draft_passes))
        self.running = gauge("num_requests_running", "Requests decoding now.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for a slot.")
        self.k_in_use = gauge("k_in_use", "The deepest draft of the last step.")
        self.rows_per_step = gauge("rows_per_step", "Rows the target scored in the last step.")
        self.drafting = gauge("requests_drafting", "Requests that drafted (K > 0) in the last step.")
        self.k_policy = gauge("k_policy_info", "How K is chosen: auto (by expected tokens per second) or rows lo-hi:K.",
                              ("k_per_load",))
        self.k_policy.labels(k_policy).set(1)
        self.ttft = histogram("time_to_first_token_seconds", "From a request's arrival to its first token.",
                              LATENCY_BUCKETS)
        self.tpot = histogram("time_per_output_token_seconds", "Seconds between a request's steps per token committed.",
                              LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "From a request's arrival to its end.", LATENCY_BUCKETS)
        self.tokens_per_step = histogram("tokens_per_step", "Tokens a request's step committed.", STEP_TOKEN_BUCKETS)


class _CounterRead:
    """A counter kept elsewhere (a draft's own pass count), read at each scrape."""

    def __init__(self, name: str, text: str, read: Callable[[], int]) -> None:
        self.name, self.text, self.read = name, text, read

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(self.name, self.text, value=self.read())


@dataclass
class ServeMetrics:
    """What a server counts: Prometheus' metrics for `/metrics`, and the numbers read back in-process."""

    k_rows: str = ""  # the K policy, for the info line
    draft_passes: Callable[[], int] | None = field(default=None, repr=False)  # a served draft model's pass count
    requests: dict[str, int] = field(default_factory=dict)  # by outcome: ok, cancelled, error, rejected
    drafted: int = 0
    accepted: int = 0
    batches: int = 0  # engine steps
    in_flight: int = 0
    prefill_chunks: int = 0
    prefix_hits: int = 0  # prompt tokens found in a slot's cells
    prefill_chunks_beside: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    exported: _Exported = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.exported = _Exported(self.k_rows, self.draft_passes)

    def queued(self, waiting: int) -> None:
        """Requests waiting for a slot now."""
        self.exported.waiting.set(waiting)

    def admitted(self, prompt_tokens: int) -> None:
        """A request's prompt was prefilled."""
        self.exported.prompt_tokens.inc(prompt_tokens)

    def prompt_cached(self, prompt_tokens: int, cached: int) -> None:
        """A request admitted: of its prompt's tokens, `cached` were in its slot's cells already."""
        with self.lock:
            self.prefix_hits += cached
        self.exported.prefix_queries.inc(prompt_tokens)
        self.exported.prefix_hits.inc(cached)

    def first_token(self, waited_s: float) -> None:
        """A request's first token came `waited_s` after it arrived."""
        self.exported.ttft.observe(waited_s)

    def step(self, in_flight: int, drafted: list[int], rows: int) -> None:
        """One engine step: requests in it, tokens each drafted, rows scored."""
        with self.lock:
            self.batches += 1
            self.in_flight = in_flight
        e = self.exported
        e.batches.inc()
        e.rows.inc(rows)
        e.draft_positions.inc(max(drafted, default=0))
        e.running.set(in_flight)
        e.k_in_use.set(max(drafted, default=0))
        e.rows_per_step.set(rows)
        e.drafting.set(sum(1 for d in drafted if d))

    def prefilled(self, beside: int) -> None:
        """A prompt chunk prefilled while `beside` requests were decoding."""
        with self.lock:
            self.prefill_chunks += 1
            self.prefill_chunks_beside += beside > 0
        self.exported.prefill_chunks.inc()
        if beside:
            self.exported.prefill_beside.inc()

    def idle(self) -> None:
        """Nothing in flight: the gauges say so."""
        with self.lock:
            self.in_flight = 0
        e = self.exported
        for gauge in (e.running, e.waiting, e.k_in_use, e.rows_per_step, e.drafting):
            gauge.set(0)

    def tokens(self, drafted: int, committed: int, gap_s: float) -> None:
        """One request's step: drafted tokens, tokens committed (accepted + the target's), seconds since its last."""
        with self.lock:
            self.drafted += drafted
            self.accepted += max(committed - 1, 0)
        e = self.exported
        e.steps.inc()
        e.drafted.inc(drafted)
        e.accepted.inc(max(committed - 1, 0))
        e.generation_tokens.inc(committed)
        if committed:
            e.tokens_per_step.observe(committed)
            e.tpot.observe(gap_s / committed)

    def finished(self, outcome: str, latency_s: float | None = None) -> None:
        """A request ended (`latency_s`: since it arrived, where it was served)."""
        with self.lock:
            self.requests[outcome] = self.requests.get(outcome, 0) + 1
        self.exported.requests.labels(outcome).inc()
        if latency_s is not None:
            self.exported.e2e.observe(latency_s)

    def text(self) -> str:
        """The Prometheus exposition."""
        return generate_latest(self.exported.registry).decode()
