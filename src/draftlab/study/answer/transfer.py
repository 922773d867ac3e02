"""What a study measured that holds on any device: acceptance per (draft, K), for predictions elsewhere
(`draftlab.perf.shapes`)."""

from __future__ import annotations

from collections import defaultdict

from draftlab.backends import engine_of_backend
from draftlab.errors import DraftlabError
from draftlab.perf.calibrate import route_of
from draftlab.perf.shapes import Acceptance, StepCounts, acceptance
from draftlab.study.answer.report import load_study
from draftlab.contenders.methods import AR, SPS
from draftlab.api import prompt_ids
from draftlab.models import load_model
from draftlab.study.run.config import SweepConfig, target_backend
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import plan


def acceptance_from(db, gguf: bool = False) -> tuple[list[Acceptance], dict[str, float]]:
    """The lossless greedy SpS cells a study ran on draftlab's torch engine (on its llama.cpp engine with `gguf`:
    what a profile timed there predicts), and that engine's plain decoding's decode tok/s per device."""
    rows, _, _ = load_study(db)
    rows = [r for r in rows if (r.get("concurrency") or 1) == 1 and r["temperature"] == 0 and r["wall_s"] > r["prefill_s"]
            and engine_of_backend(r["backend"]).runs_gguf == gguf]
    by_cell: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["method"] == SPS.name and r["identical"] and r["steps"]:
            by_cell[(r["drafter"], r["k"], r["device"])].append(r)
    cells = [_acceptance(drafter, k, device, its) for (drafter, k, device), its in sorted(by_cell.items())]
    plain = defaultdict(list)
    for r in rows:
        if r["method"] == AR.name:
            plain[r["device"]].append(r)
    if not cells:
        raise DraftlabError(f"{db} holds no lossless greedy SpS records: run a study with --methods sps first")
    return cells, {device: _decode_speed(its) for device, its in plain.items()}


def _acceptance(drafter: str, k: int, device: str, rows: list[dict]) -> Acceptance:
    return acceptance(drafter, k, device, [
        StepCounts(r["steps"], r["new_tokens"], tuple(r["drafted_per_step"]),
                   any(max(levels, default=1) > 1 for levels in r.get("levels_per_step") or ()), r["draft_s"],
                   r["overhead_s"], r["wall_s"] - r["prefill_s"]) for r in rows])


def _decode_speed(rows: list[dict]) -> float:
    seconds = sum(r["wall_s"] - r["prefill_s"] for r in rows)
    return sum(r["new_tokens"] for r in rows) / seconds if seconds > 0 else 0.0


def mean_context(db) -> int:
    """The cached tokens a study's decode steps saw on average: its prompts' mean length (in its first target's
    tokenizer) plus half its new tokens. A block's cost grows with the context (exact attention reads the whole cache
    once per row), so a shape's profile predicts this study best when timed at this context."""
    import json
    import statistics

    store = ResultsStore(db, read_only=True)
    try:
        settings = json.loads(store.get_meta("config") or "{}")
    finally:
        store.close()
    config = SweepConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in settings.items()})
    tokenizer = load_model(target_backend(config.targets[0], config.backend)[1], dtype="fp32").tokenizer
    lengths = [len(prompt_ids(tokenizer, p)) for group in plan(config) for p in group.prompts]
    return int(statistics.fmean(lengths) + config.max_new_tokens / 2)


def unlike_study(profile, db, context: int) -> str:
    """'' when a profile measured what the study's target ran on the profile's engine: the same route (a torch
    dtype and products, or llama.cpp's weight type and switches), the same model (a profile of a named model) and
    a context within 25% of the study's mean; else what differs, in one line (its error figures would compare
    unlike things)."""
    store = ResultsStore(db, read_only=True)
    try:
        envs, rows = store.environments(), store.rows()
    finally:
        store.close()
    engine = engine_of_backend(profile.backend)
    runs = {r["run_id"] for r in rows if engine_of_backend(r["backend"]).runs_gguf == engine.runs_gguf}
    envs = [env for env in envs if env["run_id"] in runs]
    routes = {route_of(env.get("numerics") or "") for env in envs} - {""}
    differs = []
    if routes and profile.route not in routes:
        differs.append(f"the profile ran route {profile.route or '?'}, the study's {engine.label} target "
                       f"{', '.join(sorted(routes))}")
    targets = {env.get("target") or "" for env in envs} - {""}
    if not profile.target.name.startswith("shape:") and targets and profile.target.name not in targets:
        differs.append(f"the profile timed {profile.target.name}, the study {', '.join(sorted(targets))}")
    if abs(profile.context_tokens / max(context, 1) - 1) > 0.25:
        differs.append(f"the profile was timed after {profile.context_tokens} cached tokens, the study's steps saw "
                       f"~{context} (`calibrate ... --context {context}`)")
    return "; ".join(differs)
