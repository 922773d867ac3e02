"""Our speculative decoder against our autoregressive loop, on the same prompts in one process.

Each prompt runs the baseline and the speculative decoder back to back, so
that drift in machine speed hits both alike. Speedup is total new tokens per
second of the speculative runs over that of the baseline runs; `identical`
counts outputs equal to the baseline token for token. Plain decoding in the
host's fastest mode of every other dtype (and route) runs beside them
(`host_baselines`), so the speedup is also stated against the fastest plain
decoding measured: "plain decoding in fp32" can be the answer.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from tqdm import tqdm

from draftlab.api import SpeculativeDecoder, prompt_ids
from draftlab.datasets import Prompt
from draftlab.drafters.adapt import AdaptingDrafter
from draftlab.drafters.base import without_memory
from draftlab.engine import GenerationConfig
from draftlab.sampling import SamplingConfig
from draftlab.metrics import GenerationStats


@dataclass(frozen=True)
class BenchSettings:
    """Generation settings shared by the baseline and the speculative runs."""

    max_new_tokens: int = GenerationConfig.max_new_tokens
    temperature: float = SamplingConfig.temperature
    top_k: int = SamplingConfig.top_k
    top_p: float = SamplingConfig.top_p
    seed: int = GenerationConfig.seed
    warmup: int = 1  # untimed runs first: the first forward passes are slow
    host_baselines: bool = True  # also time plain decoding in the host's other fast modes


@dataclass
class PromptOutcome:
    """One prompt: the baseline's and the speculative run's statistics."""

    prompt_id: str
    category: str
    baseline: GenerationStats
    speculative: GenerationStats
    identical: bool
    first_difference: int | None  # index of the first differing new token
    host_plain: dict[str, GenerationStats] = field(default_factory=dict)  # route label -> plain decoding there

    @property
    def speedup(self) -> float:
        """Tokens/s of the speculative run over the baseline's."""
        return self.speculative.tokens_per_s / self.baseline.tokens_per_s if self.baseline.tokens_per_s else 0.0


@dataclass
class BenchReport:
    """Every prompt's outcome and the aggregates derived from them."""

    outcomes: list[PromptOutcome] = field(default_factory=list)
    adapt: dict | None = None  # online adaptation's record (`AdaptingDrafter.record`), when the draft learned

    def summary(self) -> dict:
        """Aggregates over all prompts, then per category."""
        out = _aggregate(self.outcomes)
        categories = sorted({o.category for o in self.outcomes})
        out["categories"] = {c: _aggregate([o for o in self.outcomes if o.category == c]) for c in categories}
        out.update(_host_plain(self.outcomes, out))
        held = [o.speculative.cache_held for o in self.outcomes]
        if any(h is not None for h in held):  # a drafter that learns across requests: cold at first, then warm
            out["cache_held"] = {"first_prompt": held[0], "last_prompt": held[-1]}
        if self.adapt is not None:
            new_tokens = out["new_tokens"]
            out["adapt"] = {**self.adapt, "train_ms_per_token": 1000 * self.adapt["train_s"] / new_tokens
                            if new_tokens else 0.0}
        return out


def _host_plain(outcomes: list[PromptOutcome], overall: dict) -> dict:
    """The plain decodings timed in other modes, the fastest of all (the baseline included), and the speedup
    over it."""
    speeds = {"baseline": overall["baseline_tokens_per_s"]}
    for label in outcomes[0].host_plain if outcomes else []:
        runs = [o.host_plain[label] for o in outcomes]
        speeds[label] = sum(s.new_tokens for s in runs) / sum(s.wall_s for s in runs)
    fastest = max(speeds, key=speeds.get)
    return {"host_plain_tokens_per_s": speeds, "fastest_plain": fastest,
            "speedup_vs_fastest_plain": overall["tokens_per_s"] / speeds[fastest] if speeds[fastest] else 0.0}


def _aggregate(outcomes: list[PromptOutcome]) -> dict:
    base_tokens = sum(o.baseline.new_tokens for o in outcomes)
    spec_tokens = sum(o.speculative.new_tokens for o in outcomes)
    base_wall = sum(o.baseline.wall_s for o in outcomes)
    spec = [o.speculative for o in outcomes]
    spec_wall = sum(s.wall_s for s in spec)
    steps = sum(s.steps for s in spec)
    drafted = sum(s.drafted for s in spec)
    busy = sum(s.prefill_s + s.draft_s + s.target_s for s in spec)
    speedups = [o.speedup for o in outcomes]
    return {
        "prompts": len(outcomes),
        "baseline_tokens_per_s": base_tokens / base_wall if base_wall else 0.0,
        "tokens_per_s": spec_tokens / spec_wall if spec_wall else 0.0,
        "speedup": (spec_tokens / spec_wall) / (base_tokens / base_wall) if base_wall and spec_wall else 0.0,
        "speedup_min": min(speedups, default=0.0),
        "speedup_median": statistics.median(speedups) if speedups else 0.0,
        "speedup_max": max(speedups, default=0.0),
        "identical": sum(o.identical for o in outcomes),
        "new_tokens": spec_tokens,
        "tokens_per_step": spec_tokens / steps if steps else 0.0,
        "acceptance_rate": sum(s.accepted for s in spec) / drafted if drafted else 0.0,
        "draft_s": sum(s.draft_s for s in spec),
        "target_s": sum(s.target_s + s.prefill_s for s in spec),
        "overhead_s": sum(s.overhead_s for s in spec),
        "wall_s": spec_wall,
        # The throughput TAR / (t_target + t_draft) predicts from this run's own timings.
        "model_tokens_per_s": spec_tokens / busy if busy else 0.0,
    }


def run_bench(decoder: SpeculativeDecoder, prompts: list[Prompt], settings: BenchSettings, progress: bool = True) -> BenchReport:
    """Baseline and speculative decoding of every prompt, interleaved."""
    baseline = decoder.autoregressive()
    host = decoder.host_plain() if settings.host_baselines else {}
    encoded = [prompt_ids(decoder.target.tokenizer, p) for p in prompts]
    for ids in encoded[: settings.warmup]:  # suffix decoding's cache must not learn the answers timed next
        for runner in (baseline, decoder.with_drafter(without_memory(decoder.drafter)), *host.values()):
            _generate(runner, ids, settings, max_new_tokens=8)
    report = BenchReport()
    for prompt, ids in tqdm(list(zip(prompts, encoded)), desc="bench", unit="prompt", disable=not progress):
        base = _generate(baseline, ids, settings)
        spec = _generate(decoder, ids, settings)
        others = {label: _generate(plain, ids, settings).stats for label, plain in host.items()}
        difference = _first_difference(base.token_ids, spec.token_ids)
        report.outcomes.append(
            PromptOutcome(prompt.id, prompt.category, base.stats, spec.stats, difference is None, difference, others)
        )
    if isinstance(decoder.drafter, AdaptingDrafter):
        report.adapt = decoder.drafter.record()
    return report


def _generate(decoder: SpeculativeDecoder, ids: list[int], settings: BenchSettings, max_new_tokens: int | None = None):
    return decoder.generate(
        ids,
        max_new_tokens=max_new_tokens or settings.max_new_tokens,
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
        seed=settings.seed,
    )


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
