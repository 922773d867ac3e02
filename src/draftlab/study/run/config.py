"""The sweep's grid: targets x drafters x K x methods x datasets, its presets and how each cell is run.

`SweepConfig` validates a grid at construction and lists its cells per (target, dataset, temperature); the
presets are the main job (`quick`), the seeds' study on a second family (`family`) and the larger grid (`full`);
`environment` is what a record's numbers depend on (versions, host, threads, dtype, numerics).
"""

from __future__ import annotations

import json
import os
import platform
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from draftlab.api import parse_drafter_spec
from draftlab.backends import LLAMACPP, engine_of_backend
from draftlab.contenders.plain import DEFAULT_KERNELS
from draftlab.backends import check_backend_name, gguf
from draftlab.backends.fast_llama import SUPPORTED_MODEL_TYPES
from draftlab.backends.quantize import weight_type_name
from draftlab.backends.routes import cpu_flags, cpu_model, default_route, plain_contenders
from draftlab.defaults import DEFAULT_BACKEND, SHORT_RUN_TOKENS
from draftlab.engine import GenerationConfig
from draftlab.errors import DraftlabError
from draftlab.models import (LoadedModel, ModelSpec, auto_dtype, check_device, check_dtype_name, is_gguf,
                             model_config, resolve_dtype_name)
from draftlab.contenders.preflight import TIMEOUT_S as PREFLIGHT_TIMEOUT_S
from draftlab.decoding.sampling import SamplingConfig
from draftlab.study.run.cells import LLAMACPP_TARGET, Cell
from draftlab.contenders.methods import AR, PLAIN, SERVE, SERVER, SERVER_AR, choices, method_of, methods
from draftlab.contenders.server_configs import check_concurrency, parse_server_spec



def target_backend(target: str, backend: str) -> tuple[str, str]:
    """(backend, model source) of a target name: 'llamacpp:NAME' runs NAME on llama.cpp, others on `backend`."""
    if target.startswith(LLAMACPP_TARGET):
        return LLAMACPP.backend, target.removeprefix(LLAMACPP_TARGET)
    return backend, target


SEED_INPUTS = ("calibrate", "microbench")  # what `SweepConfig.seed_inputs` may name


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
    race_after: int = 0  # drop cells that trail the leader after this many prompts of a dataset (0: never; study/race.py)
    budget_s: float = 0.0  # the study's time budget: the pilot, the plan and the deadline (study/budget.py); 0: none
    servers: tuple[str, ...] = ()  # llama-server's own speculative types on GGUF targets, 'TYPE[/DRAFT][:K,...[:P,...]]'
    # (draftlab.contenders.server_configs); with any, the server's plain decoding runs too
    concurrency: tuple[int, ...] = (1,)  # requests in flight for the served engines' cells (llama-server, vLLM):
    # each level its own servers
    load_methods: tuple[str, ...] = ()  # the served methods whose cells run above one request in flight ((): all)
    load_ks: tuple[int, ...] = ()  # draftlab serve's K above one request in flight ((): the grid's); 0 is `--k auto`
    # (K chosen each step), which then also races alone
    seed_inputs: tuple[str, ...] = ()  # what the seeds' findings need beyond the cells, made after the sweep by
    # `draftlab study` (study/run/seed_inputs.py): 'calibrate' (a profile), 'microbench' (depth vs width)
    preflight_s: float = PREFLIGHT_TIMEOUT_S  # each engine decodes a few tokens in a child first, within this many
    # seconds (draftlab.contenders.preflight); an engine that dies or hangs there is left out (0: no preflight)

    def __post_init__(self) -> None:
        if not self.ks or min(self.ks) < 1:
            raise DraftlabError(f"every K must be >= 1, got {list(self.ks)}")
        unknown = set(self.methods) - set(choices())
        if unknown:
            raise DraftlabError(f"unknown method(s) {sorted(unknown)}; use {', '.join(choices())}")
        if self.limit < 1 or self.max_new_tokens < 1:
            raise DraftlabError("limit and max_new_tokens must be >= 1")
        if self.skip < 0 or self.warmup < 0 or self.baseline_every < 0 or self.race_after < 0:
            raise DraftlabError("skip, warmup, baseline_every and race_after must be >= 0")
        if not 0 <= self.budget_s < float("inf"):
            raise DraftlabError(f"the budget must be >= 0 seconds (0: none), got {self.budget_s}")
        if not 0 <= self.preflight_s < float("inf"):  # NaN fails this too
            raise DraftlabError(f"the preflight timeout must be >= 0 seconds (0: none), got {self.preflight_s}")
        check_dtype_name(self.dtype)
        check_device(self.device)
        check_backend_name(self.backend)
        for spec in self.drafters:
            parse_drafter_spec(spec)
        for t in self.temperatures:
            SamplingConfig(t)
        for spec in self.servers:
            parse_server_spec(spec)
        check_concurrency(self.concurrency)
        if min(self.load_ks, default=0) < 0 or set(self.load_methods) - set(methods()):
            raise DraftlabError(f"load_ks must be >= 0 (0: K chosen each step) and load_methods known methods, got "
                                f"{list(self.load_ks)} and {list(self.load_methods)}")
        if set(self.seed_inputs) - set(SEED_INPUTS):
            raise DraftlabError(f"unknown seed input(s) {sorted(set(self.seed_inputs) - set(SEED_INPUTS))}; use "
                                f"{', '.join(SEED_INPUTS)}")

    def cells(self, target: str, dataset: str, temperature: float) -> list[Cell]:
        """The baseline cell (and the peers' own plain decoding when they run), then every (method, drafter, K)
        cell that runs on the target's engine, then llama-server's cells at each concurrency (GGUF targets)."""
        backend, source = target_backend(target, self.backend)
        on_gguf = engine_of_backend(backend).runs_gguf
        dtype = "gguf" if on_gguf else resolve_dtype_name(self.dtype, self.device, source)
        base = Cell(target, "none", 0, AR.name, dataset, temperature, self.max_new_tokens, self.seed, dtype, backend,
                    self.device, self.skip)
        chosen = [method_of(m) for m in self.methods]
        chosen = [m for m in chosen if not (m.torch_only if on_gguf else m.gguf_only)]
        plains = {m.engine_plain for m in chosen} - {None}
        peers = [replace(base, method=m.name, concurrency=c) for m in methods().values() if m.name in plains
                 for c in self.levels(m)]
        host = [replace(base, drafter=label, method=PLAIN.name, dtype=dtype) for label, dtype in self.host_modes(target)]
        others = [
            replace(base, drafter=drafter, k=k, method=method.name, concurrency=c)
            for method in chosen if method.swept
            for drafter in self.drafters if method.runs(drafter)
            for c in self.levels(method)
            for k in self.ks_at(method, c)
        ]
        return [base, *peers, *host, *others, *(self.server_cells(base) if on_gguf else [])]

    def levels(self, method) -> tuple[int, ...]:
        """The concurrency levels a method's cells run at: every level for a served engine (of `load_methods`, where
        named), one request else."""
        loaded = method.served and (not self.load_methods or method.name in self.load_methods)
        return self.concurrency if loaded else tuple(c for c in self.concurrency if c == 1) or (1,)

    def longest_k(self) -> int:
        """The grid's longest K, alone or under load."""
        return max((*self.ks, *self.load_ks), default=0)

    def most_in_flight(self) -> int:
        """The most requests in flight any of the grid's cells runs at: the levels of its served methods that run on
        one of its targets (and of llama-server's, on a GGUF target); 1 where none does (no prompt is then held back
        as a companion)."""
        most = 1
        for target in self.targets:
            on_gguf = engine_of_backend(target_backend(target, self.backend)[0]).runs_gguf
            served = [m for m in map(method_of, self.methods)
                      if m.served and not (m.torch_only if on_gguf else m.gguf_only)]
            served += [SERVER_AR] if self.servers and on_gguf else []
            most = max([most, *(c for m in served for c in self.levels(m))])
        return most

    def ks_at(self, method, concurrency: int) -> tuple[int, ...]:
        """A swept method's K at a level: the grid's, and draftlab serve's `load_ks` above one request in flight (K 0,
        `--k auto`, alone too)."""
        if method.name != SERVE.name or not self.load_ks:
            return self.ks
        if concurrency > 1:
            return self.load_ks
        return (*self.ks, *(k for k in self.load_ks if k == 0))

    def server_cells(self, base: Cell) -> list[Cell]:
        """llama-server's plain decoding and each of its configurations, at every concurrency level (a type given
        without lengths races at the study's K, as draftlab's drafters do)."""
        if not self.servers:
            return []
        specs = [parse_server_spec(text) for text in self.servers]
        return [cell for c in self.levels(SERVER_AR) for cell in [
            replace(base, method=SERVER_AR.name, concurrency=c),
            *(replace(base, method=SERVER.name, drafter=drafter, k=k, concurrency=c)
              for spec in specs for drafter, k in spec.configurations(tuple(self.ks)))]]

    def host_modes(self, target: str) -> list[tuple[str, str]]:
        """(label, dtype) of the other modes of plain decoding timed beside the baseline: the host's fastest route
        of each other dtype (draftlab's own forward), and llama.cpp's default kernels where the model is a GGUF."""
        if not self.host_baselines or self.device.split(":")[0] not in ("cpu", "cuda"):
            return []
        backend, source = target_backend(target, self.backend)
        # llama.cpp's default kernels of a torch target's GGUF: timed once, on its llama.cpp target when it has one
        twin = not engine_of_backend(backend).runs_gguf and f"{LLAMACPP_TARGET}{target}" in self.targets
        modes = [(DEFAULT_KERNELS, "gguf")] if gguf.available() and is_gguf(source) and not twin else []
        if backend == "hf" or engine_of_backend(backend).runs_gguf:
            return modes
        config = model_config(source)
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            return modes
        dtype = resolve_dtype_name(self.dtype, self.device, source)
        routes = plain_contenders(config, self.device, default_route(config, dtype, self.device))
        return [(route.label, route.dtype) for route in routes] + modes

    def to_json(self) -> str:
        """The config as JSON (stored with the results)."""
        return json.dumps(asdict(self), sort_keys=True)


PRESETS = {
    # The main job: the shipped designed draft (as a chain, and as a tree with n-gram lookup's branch merged
    # in: the best tree in `benchmarks/trees.py`) and n-gram lookup, on prompts the designed draft never saw (2
    # each of code, summarization, chat, math), on draftlab's torch backend and on llama.cpp, beside HF's and
    # llama-cpp-python's own speculation. Every cell runs the first 4 prompts (one of each category); then the
    # race drops the cells that trail the fastest one (study/race.py), so the answer comes in minutes. The layer
    # self-draft, which never won on a CPU (docs/results.md), runs in the full preset.
    # Its llama.cpp target is SmolLM2 in Q4_0 with every tensor Q4_0 (derived once from the shipped Q4_1 at setup):
    # on x86 every product of a step then runs the repacked Q4_0 kernels, exact at every block size with draftlab's
    # build, at the stock step's price and with GEMM prefill (Q4_1 has neither; docs/backends.md).
    "quick": SweepConfig(targets=("smollm2-135m", f"{LLAMACPP_TARGET}smollm2-135m@Q4_0_PURE"),
                         drafters=("designed", "merged:ngram/tree:1:designed", "ngram", "suffix"),
                         methods=("sps", "asg", "lcp", "serve"), ks=(1, 2, 3), datasets=("heldout",), limit=8,
                         race_after=2,
                         max_new_tokens=128, baseline_every=2, budget_s=480.0,
                         servers=("ngram-mod:3", "ngram-simple:3"),  # llama-server's types at the grid's longest K
                         # draftlab serve alone and at 4 in flight (its plain decoding and `--k auto`), so that its
                         # Deploy line is a server for load; llama-server alone
                         concurrency=(1, 4), load_methods=("serve", "serve-ar"), load_ks=(0,)),
    # The seeds' study on CPU (issue 83): the Qwen2.5-Coder pair on llama.cpp, the 1.5B target in pure Q4_0 (derived
    # once from the shipped Q4_K_M, ~1.6 GB of downloads in all) on draftlab's exact kernels. Drafts with parameters:
    # the 0.5B stand-alone draft (its own pure Q4_0 file), with its whole head and with a head of its 32768 lowest token
    # ids (as FR-Spec trims a head; backends/gguf_head.py), and layer self-drafts of the 1.5B (its first 4 layers;
    # every other layer), written as GGUFs of their own (backends/gguf_layers.py); the EAGLE-3 draft of the 1.5B,
    # reading the inputs of three of its layers as llama.cpp records them (backends/llamacpp.py), where it was built
    # on this machine (`scripts/build-eagle3.sh --target qwen2.5-coder-1.5b`, ~45 min once; else its cells are skipped
    # with that line); and n-gram and suffix lookup.
    # SpS, and llama-cpp-python's prompt lookup, K 1..6, on 8 HumanEval stubs and 8 code edits, 64 tokens each,
    # within a 45-minute budget; draftlab serve (its plain decoding and each drafter it serves, the 0.5B draft in a
    # stream per slot and the EAGLE-3 draft among them) alone and at 4 in flight (`--k auto` there), so the Deploy line can serve the pair; then the calibration profile and the depth-vs-width microbenchmark the seeds'
    # findings read (study/run/seed_inputs.py). On torch (and a GPU), with HF's AsG beside SpS: `--targets
    # qwen2.5-coder-1.5b --methods sps asg`.
    "family": SweepConfig(
        targets=(f"{LLAMACPP_TARGET}qwen2.5-coder-1.5b@Q4_0_PURE",),
        drafters=("model:qwen2.5-coder-0.5b", "model:qwen2.5-coder-0.5b,head=32768", "layers:0-3", "layers:0-27:2",
                  "eagle3", "ngram", "suffix"),
        methods=("sps", "lcp", "serve"),
        ks=(1, 2, 3, 4, 5, 6),
        concurrency=(1, 4), load_methods=("serve", "serve-ar"), load_ks=(0,),
        datasets=("humaneval", "code-edit"),
        limit=8,
        max_new_tokens=64,
        race_after=2,
        budget_s=2700.0,
        seed_inputs=("calibrate", "microbench"),
    ),
    "full": SweepConfig(
        drafters=("ngram", "ngram:2-4", "layers:0-3", "layers:0-7", "layers:0-29:2"),
        datasets=("humaneval", "xsum", "mt-bench", "math", "mmlu"),
        limit=8,
        max_new_tokens=128,
    ),
}


def with_weight_types(config: SweepConfig, weight_types: tuple[str, ...]) -> SweepConfig:
    """The grid with every llama.cpp target also in each other weight type ('llamacpp:NAME@BF16': derived once with
    llama.cpp's quantizer), so that the study races type x engine x drafter x K on the same prompts."""
    names = [weight_type_name(t) for t in weight_types]
    derived = [f"{target}@{name}" for target in config.targets for name in names
               if target_backend(target, config.backend)[0] == LLAMACPP.backend and "@" not in target]
    if names and not derived:
        raise DraftlabError("--weight-types derives GGUF targets: name a llama.cpp target (llamacpp:NAME, or "
                            "--backend llamacpp)")
    return replace(config, targets=tuple(dict.fromkeys([*config.targets, *derived])))


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
        "numerics": numerics, "target": target.name if target else None,
    }


def dtype_reason(dtype: str, device: str, source: str | None = None) -> str:
    """Why the run uses its dtype: asked for, or what 'auto' chose on this hardware and why."""
    if dtype != "auto":
        return f"asked for {dtype}"
    name, reason = auto_dtype(device, source)
    return f"auto chose {name}: {reason}"
