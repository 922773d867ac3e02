"""Cheap measurements that feed the performance model.

- target: time to score blocks of 1..K_max+1 tokens at the prompts' typical
  context length (median of repeats; the cache is rolled back after each);
- each draft: time per drafted token (model drafts: one single-token forward;
  n-gram: one lookup per step) and its acceptance: one short run of our engine
  at K_max over calibration prompts gives P(accepted >= j) for j = 1..K_max,
  from which the model derives TAR at every K <= K_max;
- the engine's bookkeeping overhead per step, from the same runs.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from draftlab.api import SpeculativeDecoder, build_drafter, encode_prompt, parse_drafter_spec
from draftlab.policy import FixedK
from draftlab.backend import Backend
from draftlab.datasets import Prompt
from draftlab.drafters import ModelDrafter, NGramDrafter
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel
from draftlab.perfmodel import DraftProfile, TargetProfile, accepted_at_least, at_least
from draftlab.sampling import SamplingConfig


@dataclass(frozen=True)
class CalibrationSettings:
    """How much to measure: more repeats and tokens are slower and steadier."""

    k_max: int = 7
    max_new_tokens: int = 48
    repeats: int = 5
    backend: str = "auto"


@dataclass
class Profile:
    """A target and its drafts, measured; saved as JSON."""

    target: TargetProfile
    drafts: list[DraftProfile] = field(default_factory=list)
    context_tokens: int = 0
    seconds: float = 0.0  # wall time the calibration took

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON."""
        Path(path).write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        """Read a profile written by `save`."""
        try:
            data = json.loads(Path(path).read_text())
            target = TargetProfile(**{**data["target"], "score_s": {int(k): v for k, v in data["target"]["score_s"].items()}})
            drafts = [DraftProfile(**d) for d in data["drafts"]]
        except FileNotFoundError as exc:
            raise DraftlabError(f"profile not found: {path}; run `draftlab calibrate` first") from exc
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DraftlabError(f"{path} is not a draftlab profile ({exc})") from exc
        return cls(target, drafts, data.get("context_tokens", 0), data.get("seconds", 0.0))


def median_time(action, repeats: int) -> float:
    """Median wall seconds of `action()` over `repeats` runs, after one untimed run."""
    action()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_blocks(backend: Backend, context: list[int], sizes: range, repeats: int) -> dict[int, float]:
    """Seconds to score a block of each size on top of `context` (rolled back after each)."""
    backend.reset()
    backend.score(context[:-1], last_only=True)
    base = backend.cache_len
    block = (context * (max(sizes) // max(len(context), 1) + 2))[: max(sizes)]

    def score(n: int):
        backend.score(block[:n])
        backend.rollback(base)

    out = {}
    for n in sizes:
        out[n] = median_time(lambda: score(n), repeats)
        backend.synchronize()
    return out


def calibrate(
    target: LoadedModel, drafters: list[str], prompts: list[Prompt], settings: CalibrationSettings,
    progress: bool = True,
) -> Profile:
    """Measure the target's block times and each draft's cost and acceptance."""
    start = time.perf_counter()
    encoded = [encode_prompt(target.tokenizer, p.text, p.chat) for p in prompts]
    context_len = int(statistics.mean(len(e) for e in encoded)) + settings.max_new_tokens // 2
    context = _context_of_length(encoded, context_len)
    ar = SpeculativeDecoder.from_names(target, drafter="none", k=1, backend=settings.backend)
    score_s = time_blocks(ar.engine.target, context, range(1, settings.k_max + 2), settings.repeats)
    target_profile = TargetProfile(_name(target), score_s)
    drafts = []
    for spec in tqdm(drafters, desc="calibrate", unit="draft", disable=not progress):
        draft, draft_model = build_drafter(parse_drafter_spec(spec), target, settings.backend)
        decoder = SpeculativeDecoder(target, draft, FixedK(settings.k_max), draft_model, settings.backend,
                                     ar.target_backend)
        drafts.append(_profile_draft(spec, decoder, context, encoded, settings))
        if spec == drafters[0]:
            target_profile.overhead_s_per_step = _overhead_per_step(decoder, encoded, settings)
    return Profile(target_profile, drafts, context_len, time.perf_counter() - start)


def _name(model: LoadedModel) -> str:
    return model.name


def _context_of_length(encoded: list[list[int]], length: int) -> list[int]:
    tokens = [t for e in encoded for t in e]
    return (tokens * (length // max(len(tokens), 1) + 1))[:length]


def _profile_draft(spec, decoder: SpeculativeDecoder, context, encoded, settings) -> DraftProfile:
    drafter = decoder.drafter
    per_token, per_step = 0.0, 0.0
    if isinstance(drafter, ModelDrafter):
        per_token = time_blocks(drafter.backend, context, range(1, 2), settings.repeats)[1]
    elif isinstance(drafter, NGramDrafter):
        per_step = median_time(lambda: drafter.propose(context, settings.k_max, SamplingConfig(), None), settings.repeats)
    accepted, drafted = [], []
    for ids in encoded:
        stats = decoder.generate(ids, max_new_tokens=settings.max_new_tokens).stats
        accepted += stats.accepted_per_step_list
        drafted += stats.drafted_per_step_list
    return DraftProfile(spec, per_token, accepted_at_least(accepted, drafted, settings.k_max), per_step,
                        at_least(drafted, settings.k_max) if isinstance(drafter, NGramDrafter) else [])


def _overhead_per_step(decoder: SpeculativeDecoder, encoded, settings) -> float:
    stats = [decoder.generate(ids, max_new_tokens=settings.max_new_tokens).stats for ids in encoded[:2]]
    steps = sum(s.steps for s in stats)
    return sum(s.overhead_s for s in stats) / steps if steps else 0.0
