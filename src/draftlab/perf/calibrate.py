"""Cheap measurements that feed the performance model.

- target: time to score blocks of 1..K_max+1 tokens at the prompts' typical
  context length, and every larger block the drafts' trees produced: every size
  measured (no interpolation between the sizes drafted), in interleaved rounds
  so that drift hits every size alike; the median, its spread, and the drift;
- each draft, whatever its type, the same way: its acceptance and drafting
  cost from short runs of our engine. A run at K_max over the calibration
  prompts gives P(accepted >= j) and P(drafted >= j) for j = 1..K_max, from
  which the model derives TAR at every K <= K_max; a shorter run at K = 1
  gives a second drafting cost per step, and the two fix the cost per step
  and per drafted token (cost = per_step + per_token x drafted);
- a tree draft also gets the distribution of its node count within each depth K;
- the engine's bookkeeping overhead per step, from the same runs.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftlab.api import SpeculativeDecoder, build_drafter, prompt_ids
from draftlab.decoding.policy import FixedK
from draftlab.progress import track
from draftlab.backends.base import Backend
from draftlab.decoding.step import Block
from draftlab.files.datasets import Prompt
from draftlab.defaults import DEFAULT_BACKEND, SHORT_RUN_TOKENS
from draftlab.errors import DraftlabError
from draftlab.measure import EncodedPrompt, Measurement, RunSettings, measure, warm_up
from draftlab.models import LoadedModel
from draftlab.perf.throughput import DraftProfile, TargetProfile, accepted_at_least, at_least, prompt_standard_errors
from draftlab.files.safeio import write_atomic

WARMUP_TOKENS = 4  # an untimed generation per draft before its measured runs


@dataclass(frozen=True)
class CalibrationSettings:
    """How much to measure: more repeats and tokens are slower and steadier."""

    k_max: int = 7
    max_new_tokens: int = SHORT_RUN_TOKENS
    repeats: int = 5
    backend: str = DEFAULT_BACKEND
    short_run_prompts: int = 2  # prompts of the K = 1 runs that separate per-step from per-token drafting cost
    context: int | None = None  # cached tokens before each timed block; None: the prompts' mean plus half the tokens


@dataclass
class Profile:
    """A target and its drafts, measured; saved as JSON."""

    target: TargetProfile
    drafts: list[DraftProfile] = field(default_factory=list)
    context_tokens: int = 0
    seconds: float = 0.0  # wall time the calibration took
    device: str = ""  # where the target's costs were timed ('' in profiles older than 0.13)
    backend: str = ""  # the backend that timed them (`--backend`: 'llamacpp' is llama.cpp; '' in profiles before 0.21)
    numerics: str = ""  # the target's products there (a route, or llama.cpp's weight type and switches)

    @property
    def route(self) -> str:
        """The route the target ran, without its measurements: 'fp32 exact-wm/4', 'llama.cpp Q4_1, AMX off, ...'
        (a shape profile's older files name it inside the target's name only)."""
        name = self.target.name
        return route_of(self.numerics or (name[name.index(" (") + 2:name.rindex(")")] if " (" in name else ""))

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        write_atomic(path, json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a profile written by `save`."""
        try:
            data = json.loads(Path(path).read_text())
            fields = data["target"]
            target = TargetProfile(**{**fields, **{name: {int(k): v for k, v in fields.get(name, {}).items()}
                                                   for name in ("score_s", "score_spread", "tree_s")}})
            drafts = [DraftProfile(**d) for d in data["drafts"]]
        except FileNotFoundError as exc:
            raise DraftlabError(f"profile not found: {path}; run `draftlab calibrate` first") from exc
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # a directory, not UTF-8, not ours
            raise DraftlabError(f"{path} is not a draftlab profile ({type(exc).__name__}: "
                                f"{str(exc).splitlines()[0][:120] if str(exc) else ''})") from exc
        return cls(target, drafts, data.get("context_tokens", 0), data.get("seconds", 0.0), str(data.get("device", "")),
                   str(data.get("backend", "")), str(data.get("numerics", "")))


def route_of(numerics: str) -> str:
    """A numerics record without its measurements: 'fp32 exact-wm/2 (measured: ...)' -> 'fp32 exact-wm/2'."""
    return numerics.split(" (", 1)[0].strip()


@dataclass(frozen=True)
class BlockTimes:
    """Target block timings: medians, their spread, and the drift of the machine while they were taken."""

    median_s: dict[int, float]  # block size -> median seconds
    spread: dict[int, float]  # block size -> half the interquartile range, relative to the median
    drift: float  # relative change of speed from the first to the last third of the rounds


def time_blocks(backend: Backend, context: list[int], sizes: list[int] | range, repeats: int, tree: bool = False
                ) -> BlockTimes:
    """Seconds to score a block of each size on top of `context` (rolled back after each); with `tree`, a
    tree-shaped block of that size (`two_paths`) instead of a chain.

    Interleaved: each round times every size once, in an order rotated from round to round, so that
    a machine that speeds up or slows down during calibration shifts every size alike.
    """
    backend.reset()
    backend.score(context[:-1], last_only=True)
    base = backend.cache_len
    block = (context * (max(sizes) // max(len(context), 1) + 2))[: max(sizes)]
    sizes = list(sizes)

    def score(n: int) -> float:
        backend.synchronize()
        start = time.perf_counter()
        if tree:
            backend.score_block(two_paths(block[:n]))
        else:
            backend.score(block[:n])
        backend.synchronize()
        elapsed = time.perf_counter() - start
        backend.rollback(base)
        return elapsed

    for n in sizes:  # untimed: first calls pay one-off costs
        score(n)
    rounds = []
    for r in range(max(repeats, 1)):
        order = sizes[r % len(sizes):] + sizes[: r % len(sizes)]
        rounds.append({n: score(n) for n in order})
    median = {n: statistics.median(t[n] for t in rounds) for n in sizes}
    return BlockTimes(median, {n: _half_iqr([t[n] for t in rounds]) / median[n] for n in sizes},
                      _drift([statistics.mean(t[n] / median[n] for n in sizes) for t in rounds]))


def two_paths(tokens: list[int]) -> Block:
    """A tree of the given tokens: the root, then two paths from it of (nearly) equal lengths, as a merged draft
    (a model's chain beside an n-gram branch) proposes."""
    first = len(tokens) // 2  # nodes on the first path (the second has the rest)
    parents = [-1] + [i - 1 if i > 1 else 0 for i in range(1, first + 1)]
    parents += [0 if i == first + 1 else i - 1 for i in range(first + 1, len(tokens))]
    return Block(list(tokens), tuple(parents))


def _half_iqr(values: list[float]) -> float:
    """Half the interquartile range (0 for fewer than 4 values' worth of spread: the range / 4)."""
    if len(values) < 4:
        return (max(values) - min(values)) / 4
    q1, _, q3 = statistics.quantiles(values, n=4)
    return (q3 - q1) / 2


def _drift(relative_round_times: list[float]) -> float:
    """Relative speed change between the first and the last third of the rounds (> 0: slower at the end)."""
    third = max(len(relative_round_times) // 3, 1)
    first = statistics.mean(relative_round_times[:third])
    return statistics.mean(relative_round_times[-third:]) / first - 1.0


def calibrate(
    target: LoadedModel, drafters: list[str], prompts: list[Prompt], settings: CalibrationSettings,
    progress: bool = True,
) -> Profile:
    """Measure the target's block times and each draft's cost and acceptance."""
    start = time.perf_counter()
    encoded = [EncodedPrompt(p.id, p.category, prompt_ids(target.tokenizer, p)) for p in prompts]
    context_len = settings.context or int(statistics.mean(len(e.ids) for e in encoded)) + settings.max_new_tokens // 2
    context = _context_of_length(encoded, context_len)
    ar = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend=settings.backend)
    drafts, overhead = [], 0.0
    for spec in track(drafters, "calibrate", unit="draft", disable=not progress):
        built = build_drafter(spec, target, settings.backend)
        decoder = SpeculativeDecoder(target, built.drafter, FixedK(settings.k_max), ar.target_backend, built.model,
                                     settings.backend)
        warm_up({spec: decoder}, encoded[0], RunSettings(WARMUP_TOKENS))  # untimed: first calls pay one-off costs
        profile, overhead_s = _profile_draft(spec, decoder, encoded, settings)
        if not drafts:  # the engine's bookkeeping, from the first draft's runs
            overhead = overhead_s
        drafts.append(profile)
    blocks = time_blocks(ar.engine.target, context, block_sizes(settings.k_max, drafts), settings.repeats)
    target_profile = TargetProfile(_name(target), blocks.median_s, overhead, blocks.spread, blocks.drift)
    return Profile(target_profile, drafts, context_len, time.perf_counter() - start, target.device.type,
                   settings.backend, ar.target_backend.numerics)


def block_sizes(k_max: int, drafts: list[DraftProfile]) -> list[int]:
    """Blocks of 1..K_max+1 tokens, and 1 + every node count a tree draft produced within some depth."""
    sizes = set(range(1, k_max + 2))
    for draft in drafts:
        sizes.update(1 + int(n) for within_k in draft.tree_nodes for n, _ in within_k)
    return sorted(sizes)


def _name(model: LoadedModel) -> str:
    return model.name


def _context_of_length(encoded: list[EncodedPrompt], length: int) -> list[int]:
    tokens = [t for e in encoded for t in e.ids]
    return (tokens * (length // max(len(tokens), 1) + 1))[:length]


def _profile_draft(spec, decoder: SpeculativeDecoder, encoded, settings) -> tuple[DraftProfile, float]:
    """Acceptance and drafting cost of one draft, measured the same way for every drafter type.

    Also returns the engine's bookkeeping seconds per step in the same runs (the profile keeps the first draft's).
    """
    runs = _stats(measure({spec: decoder}, encoded, RunSettings(settings.max_new_tokens), warmup=0))
    accepted = [a for s in runs for a in s.accepted_per_step_list]
    drafted = [d for s in runs for d in s.drafted_per_step_list]
    short = decoder.with_policy(FixedK(1))
    short_runs = _stats(measure({spec: short}, encoded[: settings.short_run_prompts],
                                RunSettings(max(settings.max_new_tokens // 2, 2)), warmup=0))
    per_step, per_token = draft_cost(_cost_point(short_runs), _cost_point(runs))
    profile = DraftProfile(spec, per_token, accepted_at_least(accepted, drafted, settings.k_max), per_step,
                           at_least(drafted, settings.k_max), steps=len(accepted), cost_spread=_cost_spread(runs),
                           tree_nodes=tree_nodes(runs, settings.k_max),
                           prompt_tar_se=prompt_standard_errors([s.accepted_per_step_list for s in runs],
                                                                settings.k_max))
    return profile, _overhead_per_step(runs)


def _stats(measured: Measurement) -> list:
    """The engine's statistics of every run, in prompt order."""
    return [r.stats for runs in measured.records.values() for r in runs]


def tree_nodes(runs, k_max: int) -> list[list[list[float]]]:
    """For K = 1..K_max: (nodes within depth K, probability) over every step; empty when no step drafted a tree."""
    levels = [step for s in runs for step in s.levels_per_step_list]
    if not any(max(step, default=1) > 1 for step in levels):
        return []
    out = []
    for k in range(1, k_max + 1):
        counts = Counter(sum(step[:k]) for step in levels)
        out.append([[n, c / len(levels)] for n, c in sorted(counts.items())])
    return out


def _cost_spread(runs) -> float:
    """Relative half-IQR of the drafting seconds per step across prompts."""
    per_prompt = [s.draft_s / s.steps for s in runs if s.steps]
    if len(per_prompt) < 2 or statistics.median(per_prompt) <= 0:
        return 0.0
    return _half_iqr(per_prompt) / statistics.median(per_prompt)


def _cost_point(runs) -> tuple[float, float]:
    """(drafted tokens per step, drafting seconds per step) over generation runs."""
    steps = sum(s.steps for s in runs)
    if not steps:
        return 0.0, 0.0
    return sum(s.drafted for s in runs) / steps, sum(s.draft_s for s in runs) / steps


def draft_cost(low: tuple[float, float], high: tuple[float, float]) -> tuple[float, float]:
    """(seconds per step, seconds per drafted token) through two (drafted/step, seconds/step) points."""
    (d_low, c_low), (d_high, c_high) = low, high
    if d_high - d_low < 0.25:  # drafted counts too close to separate: charge everything per step
        return max(c_high, c_low), 0.0
    per_token = max(0.0, (c_high - c_low) / (d_high - d_low))
    return max(0.0, c_high - per_token * d_high), per_token


def _overhead_per_step(runs) -> float:
    """The engine's bookkeeping seconds per step over generation runs."""
    steps = sum(s.steps for s in runs)
    return sum(s.overhead_s for s in runs) / steps if steps else 0.0
