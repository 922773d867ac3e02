"""What `draftlab serve` counts, and its `/metrics` page in Prometheus' text format (as vLLM's and llama-server's)."""

from __future__ import annotations

from dataclasses import dataclass, field

PREFIX = "draftlab:"


@dataclass
class ServeMetrics:
    """Counters and gauges; written on the scheduler's thread and the app's, read by `/metrics`."""

    k_rows: str = ""  # the K policy, for the info line
    requests: dict[str, int] = field(default_factory=dict)  # by outcome: ok, cancelled, error, rejected
    prompt_tokens: int = 0
    generation_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    steps: int = 0  # sequence-steps: each active sequence's draft-verify step
    batches: int = 0  # batched decodes (one per scheduler step)
    k_in_use: int = 0  # the deepest draft of the last step
    rows: int = 0  # rows the target scored, over every step
    rows_last: int = 0  # rows of the last step
    drafting_last: int = 0  # requests that drafted (K > 0) in the last step
    prefill_chunks: int = 0  # prompt chunks prefilled
    prefill_chunks_beside: int = 0  # of them, chunks prefilled between the steps of requests decoding
    in_flight: int = 0
    waiting: int = 0
    ttft_s: float = 0.0  # time to first token: sum over requests
    ttft_count: int = 0
    token_gap_s: float = 0.0  # seconds between a sequence's steps, per token committed: sum
    token_gap_count: int = 0

    def admitted(self, prompt_tokens: int, waited_s: float) -> None:
        """A request got a slot and its prompt was prefilled after `waited_s` since it arrived."""
        self.prompt_tokens += prompt_tokens
        self.ttft_s += waited_s
        self.ttft_count += 1

    def step(self, in_flight: int, drafted: list[int], rows: int) -> None:
        """One engine step: requests in it, tokens each drafted, rows scored."""
        self.batches += 1
        self.in_flight, self.k_in_use = in_flight, max(drafted, default=0)
        self.rows += rows
        self.rows_last = rows
        self.drafting_last = sum(1 for d in drafted if d)

    def prefilled(self, beside: int) -> None:
        """A prompt chunk prefilled while `beside` requests were decoding."""
        self.prefill_chunks += 1
        self.prefill_chunks_beside += beside > 0

    def idle(self) -> None:
        """Nothing in flight: the gauges say so."""
        self.in_flight = self.k_in_use = self.rows_last = self.drafting_last = 0

    def tokens(self, drafted: int, committed: int, gap_s: float) -> None:
        """One sequence's step: drafted tokens, tokens committed (accepted + the target's), seconds since its last."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += max(committed - 1, 0)
        self.generation_tokens += committed
        if committed:
            self.token_gap_s += gap_s
            self.token_gap_count += committed

    def finished(self, outcome: str) -> None:
        self.requests[outcome] = self.requests.get(outcome, 0) + 1

    def text(self) -> str:
        """The Prometheus exposition."""
        lines = []

        def metric(name: str, kind: str, help_text: str, values: dict[str, float]) -> None:
            lines.extend([f"# HELP {PREFIX}{name} {help_text}", f"# TYPE {PREFIX}{name} {kind}"])
            lines.extend(f"{PREFIX}{name}{labels} {value}" for labels, value in values.items())

        metric("request_total", "counter", "Requests ended, by outcome.",
               {f'{{outcome="{k}"}}': v for k, v in sorted(self.requests.items())} or {'{outcome="ok"}': 0})
        metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", {"": self.prompt_tokens})
        metric("generation_tokens_total", "counter", "Tokens generated.", {"": self.generation_tokens})
        metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens scored.", {"": self.drafted})
        metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.", {"": self.accepted})
        metric("steps_total", "counter", "Draft-verify steps, one per sequence per batched decode.", {"": self.steps})
        metric("batches_total", "counter", "Batched decodes.", {"": self.batches})
        metric("tokens_per_step", "gauge", "Tokens committed per sequence step, on average.",
               {"": round(self.generation_tokens / self.steps, 4) if self.steps else 0})
        metric("k_in_use", "gauge", "The deepest draft of the last step.", {"": self.k_in_use})
        metric("rows_total", "counter", "Rows the target scored.", {"": self.rows})
        metric("rows_per_step", "gauge", "Rows the target scored in the last step.", {"": self.rows_last})
        metric("requests_drafting", "gauge", "Requests that drafted (K > 0) in the last step.",
               {"": self.drafting_last})
        metric("prefill_chunks_total", "counter", "Prompt chunks prefilled.", {"": self.prefill_chunks})
        metric("prefill_chunks_beside_decoding_total", "counter",
               "Prompt chunks prefilled between the steps of requests decoding.", {"": self.prefill_chunks_beside})
        metric("num_requests_running", "gauge", "Requests decoding now.", {"": self.in_flight})
        metric("num_requests_waiting", "gauge", "Requests waiting for a slot.", {"": self.waiting})
        metric("time_to_first_token_seconds", "summary", "From a request's arrival to its prefilled prompt.",
               {"_sum": round(self.ttft_s, 6), "_count": self.ttft_count})
        metric("time_per_output_token_seconds", "summary", "Seconds between a sequence's steps per token.",
               {"_sum": round(self.token_gap_s, 6), "_count": self.token_gap_count})
        metric("k_policy_info", "gauge", "How K is chosen: auto (by expected tokens per second) or rows lo-hi:K.",
               {f'{{k_per_load="{self.k_rows}"}}': 1})
        return "\n".join(lines) + "\n"
