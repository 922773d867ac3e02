"""Our speculative decoder against our autoregressive loop, on the same prompts in one process.

The measurement loop (`draftlab.measure`) runs the baseline, the speculative decoder and plain decoding in the
host's fastest mode of every other dtype (and route, `draftlab.contenders.plain.host_plain`) on each prompt, interleaved, so
that drift in machine speed hits all alike. Speedups are the loop's, both kinds named: `speedup` end to end
(prefill included) and `decode_speedup`, each over the baseline and over the fastest plain decoding measured
("plain decoding in fp32" can be the answer); `identical` counts outputs equal to the baseline token for token.
With `servers` (a GGUF target), llama-server's plain decoding joins the plain decodings and each of its own
speculative configurations runs in the same loop, reported against the server's plain decoding (its outputs
compared with it: lossless only up to rounding).
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from draftlab.api import SpeculativeDecoder, prompt_ids
from draftlab.files.datasets import Prompt
from draftlab.measure import DECODE, END_TO_END, EncodedPrompt, Measurement, RunRecord, RunSettings, measure
from draftlab.models import gguf_path
from draftlab.contenders.plain import autoregressive, host_plain
from draftlab.contenders.server_configs import ServerPool, parse_server_spec, spec_config

BASELINE, SPECULATIVE, SERVER_PLAIN = "baseline", "speculative", "llama-server plain"


@dataclass(frozen=True)
class BenchSettings(RunSettings):
    """The generation settings every run shares (`RunSettings`), and bench's own."""

    warmup: int = 1  # untimed runs first: the first forward passes are slow
    host_baselines: bool = True  # also time plain decoding in the host's other fast modes


@dataclass
class BenchReport:
    """The measurement, and what the drafter learned across the prompts (`Drafter.learned`)."""

    measured: Measurement
    learned: dict | None = None
    server_types: list[str] = field(default_factory=list)  # keys of llama-server's speculative configurations

    def summary(self) -> dict:
        """Aggregates over all prompts, then per category."""
        out = _aggregate(self.measured, None)
        categories = sorted({r.category for r in self.measured.records[SPECULATIVE]})
        out["categories"] = {c: _aggregate(self.measured, c) for c in categories}
        out.update(_host_plain(self.measured, self.server_types))
        if self.server_types:
            out["llama_server"] = _servers(self.measured, self.server_types)
        held = [r.stats.cache_held for r in self.measured.records[SPECULATIVE]]
        if any(h is not None for h in held):  # a drafter that learns across requests: cold at first, then warm
            out["cache_held"] = {"first_prompt": held[0], "last_prompt": held[-1]}
        if self.learned is not None:
            new_tokens = out["new_tokens"]
            out["adapt"] = {**self.learned, "train_ms_per_token": 1000 * self.learned["train_s"] / new_tokens
                            if new_tokens else 0.0}
        return out


def _servers(measured: Measurement, types: list[str]) -> dict:
    """Each llama-server configuration against the server's plain decoding on the same prompts."""
    plain = measured.records[SERVER_PLAIN]
    return {key: {"tokens_per_s": measured.tokens_per_s(key, END_TO_END) or 0.0,
                  "speedup": measured.speedup(key, SERVER_PLAIN, END_TO_END) or 0.0,
                  "decode_speedup": measured.speedup(key, SERVER_PLAIN, DECODE) or 0.0,
                  "identical": sum(_identical(r, b) for r, b in zip(measured.records[key], plain)),
                  "drafted": sum(r.stats.drafted for r in measured.records[key]),
                  "accepted": sum(r.stats.accepted for r in measured.records[key])} for key in types}


def _host_plain(measured: Measurement, server_types: list[str] = ()) -> dict:
    """The plain decodings timed in every mode (the baseline included), the fastest, and the speedups over it."""
    labels = [key for key in measured.records if key != SPECULATIVE and key not in server_types]
    speeds = {label: measured.tokens_per_s(label, END_TO_END) or 0.0 for label in labels}
    fastest = max(speeds, key=speeds.get)
    return {"host_plain_tokens_per_s": speeds, "fastest_plain": fastest,
            "speedup_vs_fastest_plain": measured.speedup(SPECULATIVE, fastest, END_TO_END) or 0.0,
            "decode_speedup_vs_fastest_plain": measured.speedup(SPECULATIVE, fastest, DECODE) or 0.0}


def _aggregate(measured: Measurement, category: str | None) -> dict:
    """The speculative runs against the baseline's, over the prompts of `category` (None: all)."""
    subset = Measurement({key: [r for r in runs if category in (None, r.category)]
                          for key, runs in measured.records.items()})
    spec = subset.records[SPECULATIVE]
    stats = [r.stats for r in spec]
    steps = sum(s.steps for s in stats)
    drafted = sum(s.drafted for s in stats)
    new_tokens = sum(r.new_tokens for r in spec)
    busy = sum(s.prefill_s + s.draft_s + s.target_s for s in stats)
    speedups = subset.per_prompt(SPECULATIVE, BASELINE, END_TO_END)
    return {
        "prompts": len(spec),
        "baseline_tokens_per_s": subset.tokens_per_s(BASELINE, END_TO_END) or 0.0,
        "tokens_per_s": subset.tokens_per_s(SPECULATIVE, END_TO_END) or 0.0,
        "speedup": subset.speedup(SPECULATIVE, BASELINE, END_TO_END) or 0.0,
        "decode_speedup": subset.speedup(SPECULATIVE, BASELINE, DECODE) or 0.0,
        "speedup_min": min(speedups, default=0.0),
        "speedup_median": statistics.median(speedups) if speedups else 0.0,
        "speedup_max": max(speedups, default=0.0),
        "identical": sum(_identical(r, b) for r, b in zip(spec, subset.records[BASELINE])),
        "new_tokens": new_tokens,
        "tokens_per_step": new_tokens / steps if steps else 0.0,
        "acceptance_rate": sum(s.accepted for s in stats) / drafted if drafted else 0.0,
        "draft_s": sum(s.draft_s for s in stats),
        "target_s": sum(s.target_s + s.prefill_s for s in stats),
        "overhead_s": sum(s.overhead_s for s in stats),
        "wall_s": sum(s.wall_s for s in stats),
        # The throughput TAR / (t_target + t_draft) predicts from this run's own timings.
        "model_tokens_per_s": new_tokens / busy if busy else 0.0,
    }


def _identical(run: RunRecord, baseline: RunRecord) -> bool:
    return run.prompt_id == baseline.prompt_id and run.token_ids == baseline.token_ids


def run_bench(decoder: SpeculativeDecoder, prompts: list[Prompt], settings: BenchSettings, progress: bool = True,
              servers: list[str] = ()) -> BenchReport:
    """Baseline, speculative decoding and the host's other plain modes on every prompt, interleaved; with
    `servers` ('TYPE[/DRAFT][:K,...]'), llama-server's plain decoding and those configurations of its own too, each
    server stopped when the bench ends."""
    contenders = {BASELINE: autoregressive(decoder), SPECULATIVE: decoder,
                  **(host_plain(decoder) if settings.host_baselines else {})}
    encoded = [EncodedPrompt(p.id, p.category, prompt_ids(decoder.target.tokenizer, p)) for p in prompts]
    with tempfile.TemporaryDirectory(prefix="draftlab-servers-") as logs:
        pool = ServerPool(Path(logs))
        try:
            types = _add_servers(contenders, pool, decoder, servers) if servers else []
            measured = measure(contenders, encoded, settings, warmup=settings.warmup,
                               progress="bench" if progress else "")
        finally:
            pool.stop_all()
    return BenchReport(measured, decoder.drafter.learned(), types)


def _add_servers(contenders: dict, pool: ServerPool, decoder: SpeculativeDecoder, servers: list[str]) -> list[str]:
    """llama-server's plain decoding and each configuration as contenders; the configurations' keys."""
    model = gguf_path(decoder.target.source)
    configs = {f"llama-server {drafter}" + (f" K={k}" if k else ""): (drafter, k)
               for spec in map(parse_server_spec, servers) for drafter, k in spec.configurations()}
    contenders[SERVER_PLAIN] = pool.contender(spec_config(model, "none", 0))
    contenders.update({key: pool.contender(spec_config(model, *config)) for key, config in configs.items()})
    return list(configs)
