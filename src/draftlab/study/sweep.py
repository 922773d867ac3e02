"""Run a grid of cells over prompts and store one record per (cell, prompt), resumably.

For every target and prompt, the autoregressive cell runs first; then every
(method, drafter, K) cell runs on the same prompt, so that all cells of a
prompt are measured close together in time. The autoregressive cell is
re-timed every `baseline_every` cells and after the prompt's last cell (the
baseline checks): the report compares each cell with the baseline measured
closest in time and flags the study as noisy when the baseline drifted.
Finished (cell, prompt) pairs in the database are skipped, which makes a killed sweep resume where it stopped
and a finished sweep a no-op. Suffix decoding learns across requests: each of its cells keeps its own cache over
its prompts in order (beside the database, so a resumed cell goes on with what it had learned), and `cache_held`
records how many earlier responses it held at each prompt.
"""

from __future__ import annotations

import json
import os
import platform
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from tqdm import tqdm

from draftlab.backends import check_backend_name, gguf
from draftlab.backends.fast_llama import SUPPORTED_MODEL_TYPES
from draftlab.backends.routes import cpu_flags, cpu_model, default_route, plain_contenders
from draftlab.api import LLAMACPP_PLAIN, parse_drafter_spec, prompt_ids
from draftlab.datasets import Prompt, load_prompts
from draftlab.defaults import DEFAULT_BACKEND, SHORT_RUN_TOKENS
from draftlab.engine import GenerationConfig
from draftlab.errors import DraftlabError
from draftlab.models import (LoadedModel, ModelSpec, auto_dtype, check_device, check_dtype_name, is_gguf,
                             load_model, model_config, resolve_dtype_name)
from draftlab.sampling import SamplingConfig
from draftlab.study.runner import CellRunner
from draftlab.study.pruning import RaceRule, dropped_cells, model_of
from draftlab.study.store import (LLAMACPP_ONLY, LLAMACPP_TARGET as LLAMACPP, PEER_METHODS, PEER_PLAIN, Cell, Record,
                                  ResultsStore)

METHODS = ("ar", "sps", "asg", "hf", "lcp", "llama")  # 'plain' cells follow host_baselines, not --methods
TORCH_ONLY = ("asg", "hf")  # HF's methods run torch targets


def target_backend(target: str, backend: str) -> tuple[str, str]:
    """(backend, model source) of a target name: 'llamacpp:NAME' runs NAME on llama.cpp, others on `backend`."""
    if target.startswith(LLAMACPP):
        return "llamacpp", target.removeprefix(LLAMACPP)
    return backend, target


@dataclass(frozen=True)
class SweepConfig:
    """The grid and how each cell is run."""

    targets: tuple[str, ...] = ("smollm2-135m",)
    drafters: tuple[str, ...] = ("ngram", "layers:0-3")
    ks: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7)
    methods: tuple[str, ...] = ("sps", "asg")  # 'ar' always runs: it is every cell's baseline; 'hf' runs with 'asg'
    datasets: tuple[str, ...] = ("mixed",)
    temperatures: tuple[float, ...] = (0.0,)
    limit: int = 3  # prompts per dataset, spread over its categories
    skip: int = 0  # prompts passed over first (e.g. those a designed draft was trained on)
    max_new_tokens: int = SHORT_RUN_TOKENS
    warmup: int = 1
    baseline_every: int = 6  # re-time the baseline after this many cells of a prompt (0: never)
    seed: int = GenerationConfig.seed
    device: str = ModelSpec.device
    dtype: str = ModelSpec.dtype
    backend: str = DEFAULT_BACKEND
    host_baselines: bool = True  # also time plain decoding in the host's fastest mode of each dtype ('plain' cells)
    race_after: int = 0  # drop cells that trail the leader after this many prompts of a dataset (0: never; pruning.py)

    def __post_init__(self) -> None:
        if not self.ks or min(self.ks) < 1:
            raise DraftlabError(f"every K must be >= 1, got {list(self.ks)}")
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise DraftlabError(f"unknown method(s) {sorted(unknown)}; use {', '.join(METHODS)}")
        if self.limit < 1 or self.max_new_tokens < 1:
            raise DraftlabError("limit and max_new_tokens must be >= 1")
        if self.skip < 0 or self.warmup < 0 or self.baseline_every < 0 or self.race_after < 0:
            raise DraftlabError("skip, warmup, baseline_every and race_after must be >= 0")
        check_dtype_name(self.dtype)
        check_device(self.device)
        check_backend_name(self.backend)
        for spec in self.drafters:
            parse_drafter_spec(spec)
        for t in self.temperatures:
            SamplingConfig(t)

    def cells(self, target: str, dataset: str, temperature: float) -> list[Cell]:
        """The baseline cell (and the peers' own plain decoding when they run), then every (method, drafter, K)
        cell that runs on the target's engine."""
        backend, source = target_backend(target, self.backend)
        dtype = "gguf" if backend == "llamacpp" else resolve_dtype_name(self.dtype, self.device, source)
        base = Cell(target, "none", 0, "ar", dataset, temperature, self.max_new_tokens, self.seed, dtype, backend,
                    self.device, self.skip)
        methods = [m for m in self.methods if m not in (TORCH_ONLY if backend == "llamacpp" else LLAMACPP_ONLY)]
        peers = [replace(base, method=plain) for peer, plain in PEER_PLAIN.items() if {peer, plain} & set(methods)]
        host = [replace(base, drafter=label, method="plain", dtype=dtype) for label, dtype in self.host_modes(target)]
        others = [
            replace(base, drafter=drafter, k=k, method=method)
            for method in methods if method not in ("ar", *PEER_PLAIN.values())
            for drafter in self.drafters if method != "lcp" or drafter.startswith("ngram")
            for k in self.ks
        ]
        return [base, *peers, *host, *others]

    def host_modes(self, target: str) -> list[tuple[str, str]]:
        """(label, dtype) of the other modes of plain decoding timed beside the baseline: the host's fastest route
        of each other dtype (draftlab's own forward), and llama.cpp's default kernels where the model is a GGUF."""
        if not self.host_baselines or self.device != "cpu":
            return []
        backend, source = target_backend(target, self.backend)
        modes = [(LLAMACPP_PLAIN, "gguf")] if gguf.available() and is_gguf(source) else []
        if backend in ("hf", "llamacpp"):
            return modes
        config = model_config(source)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            return modes
        dtype = resolve_dtype_name(self.dtype, self.device, source)
        routes = plain_contenders(config, self.device, default_route(config, dtype))
        return [(route.label, route.dtype) for route in routes] + modes

    def to_json(self) -> str:
        """The config as JSON (stored with the results)."""
        return json.dumps(asdict(self), sort_keys=True)


PRESETS = {
    # The main job: the shipped designed draft (as a chain, and as a tree with n-gram lookup's branch merged
    # in: the best tree in `benchmarks/trees.py`) and n-gram lookup, on prompts the designed draft never saw (2
    # each of code, summarization, chat, math), on draftlab's torch backend and on llama.cpp, beside HF's and
    # llama-cpp-python's own speculation. Every cell runs the first 4 prompts (one of each category); then the
    # race drops the cells that trail the fastest one (pruning.py), so the answer comes in minutes. The layer
    # self-draft, which never won on a CPU (docs/results.md), runs in the full preset.
    "quick": SweepConfig(targets=("smollm2-135m", f"{LLAMACPP}smollm2-135m"),
                         drafters=("designed", "merged:ngram/tree:1:designed", "ngram"),
                         methods=("sps", "asg", "lcp"), ks=(1, 2, 3), datasets=("heldout",), limit=8, race_after=4),
    # The seeds' study on a second family (the Qwen2.5-Coder pair, ~1.6 GB of downloads): the 0.5B stand-alone
    # draft (in the target's dtype and in bf16, which drafts ~2x faster on CPUs; README), layer self-drafts of the
    # 1.5B at two depths (it has 28 layers) and n-gram lookup, SpS and AsG, K 1..7,
    # on code, chat, math and summarization. In fp32 on 2 CPU cores the 1.5B decodes ~3 tokens/s, so this grid
    # (5 drafts x 7 K x 2 methods x 16 prompts x 64 tokens) takes hours there; on a GPU, minutes. With
    # `--backend llamacpp` the Q4_K_M files run as shipped: the 0.5B and n-gram drafts (the others need torch
    # weights and are skipped), SpS and llama-cpp-python's prompt lookup (lcp).
    "family": SweepConfig(
        targets=("qwen2.5-coder-1.5b",),
        drafters=("model:qwen2.5-coder-0.5b", "model:qwen2.5-coder-0.5b@bf16", "layers:0-3", "layers:0-27:4", "ngram"),
        methods=("sps", "asg", "lcp"),  # with --backend llamacpp: SpS and llama-cpp-python's lookup (asg needs torch)
        datasets=("humaneval", "mt-bench", "math", "xsum"),
        limit=4,
        max_new_tokens=64,
    ),
    "full": SweepConfig(
        drafters=("ngram", "ngram:2-4", "layers:0-3", "layers:0-7", "layers:0-29:2"),
        datasets=("humaneval", "xsum", "mt-bench", "math", "mmlu"),
        limit=8,
        max_new_tokens=128,
    ),
}


def load_config(path: str | Path) -> dict:
    """Grid settings from a TOML file (keys as in SweepConfig)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as exc:
        raise DraftlabError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise DraftlabError(f"{path} is not valid TOML: {exc}") from exc
    data = data.get("sweep", data)
    known = {f.name for f in fields(SweepConfig)}
    unknown = set(data) - known
    if unknown:
        raise DraftlabError(f"{path}: unknown setting(s) {sorted(unknown)}; known: {sorted(known)}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}


def make_config(preset: str = "quick", file: str | None = None, **overrides) -> SweepConfig:
    """A preset, updated by a config file, updated by explicit overrides (None values ignored)."""
    if preset not in PRESETS:
        raise DraftlabError(f"unknown preset {preset!r}; use one of {', '.join(PRESETS)}")
    config = PRESETS[preset]
    settings = load_config(file) if file else {}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return replace(config, **settings)
    except TypeError as exc:
        raise DraftlabError(f"bad sweep setting: {exc}") from exc


def environment(config: SweepConfig, target: LoadedModel | None = None, numerics: str = "", source: str | None = None
                ) -> dict:
    """Versions, host, threads, dtype and the products the target ran: what a record's numbers depend on."""
    import torch
    import transformers

    import draftlab

    return {
        "draftlab": draftlab.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
        "python": platform.python_version(), "platform": platform.platform(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "device": config.device,
        "dtype": str(target.dtype).removeprefix("torch.") if target else config.dtype, "backend": config.backend,
        "dtype_reason": dtype_reason(config.dtype, config.device, source),
        "cpu": cpu_model(), "cpu_flags": " ".join(sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16",
                                                                          "avx512_fp16", "amx_bf16", "amx_fp16"})),
        "numerics": numerics,
    }


def dtype_reason(dtype: str, device: str, source: str | None = None) -> str:
    """Why the run uses its dtype: asked for, or what 'auto' chose on this hardware and why."""
    if dtype != "auto":
        return f"asked for {dtype}"
    name, reason = auto_dtype(device, source)
    return f"auto chose {name}: {reason}"


@dataclass
class TargetRun:
    """One target loaded for a sweep: its cell runner, its run id and the drafters that cannot run on it."""

    runner: CellRunner
    run_id: int
    gone: set[str]
    no_asg: set[str]

    def runnable(self, cells: list[Cell]) -> list[Cell]:
        """The cells whose drafter runs on this target's engine (and has an HF counterpart, for asg)."""
        return [c for c in cells if c.drafter not in self.gone and not (c.method == "asg" and c.drafter in self.no_asg)]


@dataclass(frozen=True)
class Group:
    """One dataset at one temperature: its prompts, and the cells of each target that run on them."""

    dataset: str
    temperature: float
    prompts: list[Prompt]
    cells: dict[str, list[Cell]]  # target name -> its cells


def run_sweep(config: SweepConfig, store: ResultsStore, progress: bool = True) -> int:
    """Run every cell not yet in `store` (measured or skipped); returns the number of records added.

    Prompts are the outer loop and targets the inner one, so that every engine's cells of a prompt are measured
    close together in time and the race (`config.race_after`) compares engines on the same prompts."""
    store.set_meta("config", config.to_json())
    done = store.done()
    groups = _plan(config)
    todo = sum(1 for g in groups for t, cells in g.cells.items() for c in cells for p in g.prompts
               if (c.key, p.id) not in done)
    if todo == 0:
        return 0
    targets = {name: _start_target(name, config, store, done) for name in config.targets}
    todo = sum(1 for g in groups for t, cells in g.cells.items() for c in targets[t].runnable(cells) for p in g.prompts
               if (c.key, p.id) not in done)
    bar = tqdm(total=todo, desc="sweep", unit="run", disable=not progress)
    added = sum(_run_group(g, targets, config, store, done, bar) for g in groups)
    bar.close()
    return added


def _start_target(name: str, config: SweepConfig, store: ResultsStore, done: set) -> TargetRun:
    """Load a target, build its cell runner, record the run's environment and the parameter counts."""
    backend, source = target_backend(name, config.backend)
    target = load_model(source, device=config.device, dtype="auto" if backend == "llamacpp" else config.dtype,
                        backend=backend)
    runner = CellRunner(target, config, backend, store.path.with_name(store.path.stem + ".suffix-caches"), done)
    run_id = store.start_run(environment(config, target, runner.baseline.target_backend.numerics, source))
    gone, no_asg = _unrunnable(runner, config)
    _record_params(store, runner, config, name, gone)
    return TargetRun(runner, run_id, gone, no_asg)


def _run_group(group: Group, targets: dict[str, TargetRun], config: SweepConfig, store: ResultsStore, done: set,
               bar: tqdm) -> int:
    """Every prompt of one dataset and temperature on every target; returns the number of records added."""
    cells = {name: targets[name].runnable(group.cells[name]) for name in group.cells}
    encoded = {name: {p.id: prompt_ids(targets[name].runner.target.tokenizer, p) for p in group.prompts}
               for name in cells}
    for name, its_cells in cells.items():
        if config.warmup and any((c.key, p.id) not in done for c in its_cells for p in group.prompts):
            first = min(group.prompts, key=lambda p: len(encoded[name][p.id]))  # the cheapest; it fits if any does
            targets[name].runner.warm_up(its_cells, first, encoded[name][first.id])
    added = 0
    for index, prompt in enumerate(group.prompts):
        if index >= config.race_after > 0:
            _drop_trailing(group, cells, index, store, done, bar, targets, config)
        for name, its_cells in cells.items():
            added += _run_prompt(targets[name], its_cells, prompt, encoded[name][prompt.id], store, done, bar, config)
    return added


def _run_prompt(target: TargetRun, cells: list[Cell], prompt: Prompt, ids: list[int], store: ResultsStore,
                done: set, bar: tqdm, config: SweepConfig) -> int:
    """The target's pending cells on one prompt, with baseline re-checks between them; returns records added."""
    pending = [c for c in cells if (c.key, prompt.id) not in done]
    since_check = added = 0
    for index, cell in enumerate(pending):
        bar.set_postfix_str(f"{cell.method} {cell.drafter} k={cell.k}", refresh=False)
        record = _measure(target, cell, prompt, ids, store)
        done.add((cell.key, prompt.id))
        bar.update()
        if record is None:
            continue
        added += 1
        since_check = 0 if cell.method == "ar" else since_check + 1
        if config.baseline_every and since_check and (since_check >= config.baseline_every or index + 1 == len(pending)):
            store.add_baseline_check(target.runner.run(cell.baseline(), prompt, ids), target.run_id)
            since_check = 0
    return added


def _measure(target: TargetRun, cell: Cell, prompt: Prompt, ids: list[int], store: ResultsStore) -> Record | None:
    """Run and store one (cell, prompt); a cell that cannot run the prompt is stored as skipped, with the reason in
    one line (draftlab's own errors for every method; any error of a peer's library, which draftlab does not own)."""
    peer = cell.method in PEER_METHODS
    try:
        record = target.runner.run(cell, prompt, ids)
    except (Exception if peer else DraftlabError) as exc:
        reason = f"{type(exc).__name__}: {exc}" if peer and not isinstance(exc, DraftlabError) else str(exc)
        store.add_skip(cell, prompt.id, reason, target.run_id)
        print(f"sweep: {cell.method} {cell.drafter} k={cell.k} skipped {prompt.id}: {reason.splitlines()[0][:200]}")
        return None
    record.identical = _identical(store, cell, prompt.id, record.output_sha)
    target.runner.keep_cache(cell, prompt.id)
    store.add(record, target.run_id)
    return record


def _drop_trailing(group: Group, cells: dict[str, list[Cell]], index: int, store: ResultsStore, done: set,
                   bar: tqdm, targets: dict[str, TargetRun], config: SweepConfig) -> None:
    """Before prompt `index`: the race drops, per model, the cells that trail its leader; each dropped cell is
    stored as skipped on every prompt it has left, so a resumed sweep makes the same decision."""
    from draftlab.study.report import baseline_drift

    rows = [r for r in store.rows() if r["dataset"] == group.dataset and r["temperature"] == group.temperature]
    checks = [c for c in store.baseline_checks() if c["dataset"] == group.dataset]
    drift = baseline_drift(rows, checks).spread
    models: dict[str, list[str]] = {}
    for name in cells:
        models.setdefault(model_of(name), []).append(name)
    rule = RaceRule(config.race_after)
    for model, names in models.items():
        contenders = {c.key: c for name in names for c in cells[name]}
        newly = []
        for key, reason in dropped_cells(list(contenders.values()), rows, rule, drift).items():
            left = [p for p in group.prompts[index:] if (key, p.id) not in done]
            for prompt in left:
                store.add_skip(contenders[key], prompt.id, reason, targets[contenders[key].target].run_id)
                done.add((key, prompt.id))
            bar.total -= len(left)
            newly += [contenders[key]] if left else []
        if newly:
            print(f"sweep: the race dropped {len(newly)} cell(s) of {model} after {index} prompts of {group.dataset} "
                  f"(slower than the leader by more than the margin; the report lists each): "
                  f"{', '.join(f'{c.method} {c.drafter} k={c.k}' for c in newly)}")


def _unrunnable(runner: CellRunner, config: SweepConfig) -> tuple[set[str], set[str]]:
    """Drafters that do not run on the target's engine, and those with no HF counterpart for asg; says which."""
    gone = {d for d in config.drafters if not runner.runs_here(d)}
    asg = "asg" in config.methods and runner.backend != "llamacpp"
    no_asg = {d for d in config.drafters if asg and d not in gone and not runner.asg_supported(d)}
    for drafter in sorted(gone):
        print(f"sweep: {drafter} does not run on {runner.target.name} with the {runner.backend} backend; "
              "its cells are skipped")
    for drafter in sorted(no_asg):
        print(f"sweep: no HF assisted-generation counterpart for {drafter}; its asg cells are skipped")
    return gone, no_asg


def _record_params(store: ResultsStore, runner: CellRunner, config: SweepConfig, target_name: str,
                   gone: set[str] = frozenset()) -> None:
    """Parameter counts of the target and of every model draft that runs (`gone`: those that do not), for the
    scaling ratio."""
    store.set_params(target_name, runner.target.num_parameters())
    for drafter in set(config.drafters) - gone:
        draft = runner.decoder(drafter, 1).draft_model
        if draft is not None:
            store.set_params(f"{target_name}::{drafter}", draft.num_parameters())


def _plan(config: SweepConfig) -> list[Group]:
    """One group per (dataset, temperature), with the cells of every target."""
    prompts = {d: load_prompts(d, config.limit, config.skip) for d in config.datasets}
    return [Group(d, temp, prompts[d], {t: config.cells(t, d, temp) for t in config.targets})
            for d in config.datasets for temp in config.temperatures]


def _identical(store: ResultsStore, cell: Cell, prompt_id: str, output_sha: str) -> bool | None:
    """Equality with the output of plain decoding on the cell's own engine: only defined for greedy decoding."""
    if cell.temperature > 0 or cell.method in ("plain", "llama"):  # another mode's or library's plain decoding
        return None
    if cell.method == "ar":
        return True
    baseline = store.output_sha(cell.engine_baseline(), prompt_id)
    return None if baseline is None else baseline == output_sha
