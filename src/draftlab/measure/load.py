"""The loop under load: a server answering N requests at once.

`InFlight` sends a prompt together with N-1 companion prompts (the sweep's cells at concurrency N): its record is the
prompt's own output, the window's wall time, the window's new tokens and its requests' mean latency. `measure_load`
sends every prompt with N requests in flight (serve-check's levels). The figure is the aggregate: all requests' new
tokens over the wall time from the first request sent to the last answer, beside each request's own latency.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Hashable, Mapping, Sequence

from draftlab.engine import GenerationResult
from draftlab.measure.loop import Contender, EncodedPrompt, RunRecord, RunSettings, run_once, warm_up


@dataclass(frozen=True)
class InFlight:
    """A contender that serves requests at once (a server with that many slots), timed under load: each prompt is
    sent together with `companions` (one request a thread, all at once). The result is the prompt's own output;
    its statistics carry the window's new tokens (all requests) and its requests' mean latency, and the loop's
    time is the window's, from the first request sent to the last answer."""

    contender: Contender
    companions: tuple[EncodedPrompt, ...]
    times_prefill = False  # requests overlap: no prefill of the window is apart from its decoding
    reuses_prefill = False  # each request of the window prefills its prompt
    prefill_key = ""

    def prefill(self, prompt_ids: list[int]) -> None:
        """Nothing: each request prefills under load."""

    def take_prefill(self, prompt_ids: list[int]) -> None:
        """Nothing (its key is '': never shared)."""

    def run(self, prompt_ids: list[int], settings: RunSettings) -> GenerationResult:
        timed = _in_flight(self.contender, [prompt_ids, *(c.ids for c in self.companions)], settings)
        own = timed[0][0]
        stats = replace(own.stats, window_tokens=sum(len(r.token_ids) for r, _ in timed),
                        latency_s=statistics.mean(seconds for _, seconds in timed))
        return GenerationResult(own.token_ids, own.text, stats)

    def forgetful(self) -> "InFlight":
        return InFlight(self.contender.forgetful(), self.companions)


def _in_flight(contender: Contender, prompts: Sequence[list[int]], settings: RunSettings
               ) -> list[tuple[GenerationResult, float]]:
    """Every prompt's request sent at once; each result with its seconds from sending to answer."""
    def one(ids: list[int]) -> tuple[GenerationResult, float]:
        start = time.perf_counter()
        result = contender.run(ids, settings)
        return result, time.perf_counter() - start

    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        return list(pool.map(one, prompts))


@dataclass
class LoadRun:
    """One contender answering every prompt with `concurrency` requests in flight."""

    key: Hashable
    concurrency: int
    records: list[RunRecord]  # in prompt order; each record's wall time is its own request's latency
    wall_s: float  # first request sent to last answer

    @property
    def tokens_per_s(self) -> float:
        """Aggregate new tokens per second."""
        return sum(r.new_tokens for r in self.records) / self.wall_s if self.wall_s else 0.0

    @property
    def latency_s(self) -> float:
        """Mean seconds of one request, from sending it to its answer."""
        return statistics.mean(r.stats.wall_s for r in self.records) if self.records else 0.0


def measure_load(contenders: Mapping[Hashable, Contender], prompts: Sequence[EncodedPrompt], settings: RunSettings,
                 concurrency: int) -> dict[Hashable, LoadRun]:
    """Each contender answers every prompt with `concurrency` requests in flight (one thread a request), one contender
    after the other, after a warm-up request. Only for contenders that serve requests at once (a server with that
    many slots): draftlab's own decoder runs one generation at a time."""
    out = {}
    for key, contender in contenders.items():
        warm_up({key: contender}, prompts[0], settings)
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            records = list(pool.map(lambda prompt: run_once(key, contender, prompt, settings), prompts))
        out[key] = LoadRun(key, concurrency, records, time.perf_counter() - start)
    return out
