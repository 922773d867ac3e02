"""What the seeds' findings need beyond a sweep, measured after it into the study's folder.

Two of the seeds' six findings are not about the study's cells: "the simplified model TAR / (t_target + t_draft) is
within 3.5% of measurement" needs a calibration profile to predict the cells with, and "draft latency grows with
depth and hardly with width" a depth/width microbenchmark. A preset that names them in `seed_inputs` has the study
make them itself, once the sweep is done (never beside it: both are timings):

- 'calibrate': `perf.calibrate` of the study's first target on its engine, with the drafts of the grid that run
  there, at K up to the grid's largest, on the first prompts of each dataset: `profile.json`;
- 'microbench': `design.microbench`'s fixed-width and fixed-depth series, random weights in the shape of the grid's
  first model draft (a draft's latency is what the finding is about; the target's shape where there is none):
  `microbench.json`.

Each file is written atomically and kept: a resumed study measures only what is missing. A step that fails says why
in one line and the report goes on without it (its finding then reads "not measured").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from draftlab.errors import DraftlabError
from draftlab.study.run.config import SweepConfig, target_backend

PROFILE, MICROBENCH = "profile.json", "microbench.json"
CALIBRATION_PROMPTS = 2  # prompts a calibration runs each draft on, spread over the datasets (one each at least)
MICROBENCH_SERIES = ("fixed_width", "fixed_depth")  # what the depth-vs-width finding reads


@dataclass(frozen=True)
class SeedInputs:
    """The files made for the report (None: not asked for, or could not be made)."""

    profile: Path | None = None
    microbench: Path | None = None


def make_seed_inputs(config: SweepConfig, out: Path, progress: bool = True) -> SeedInputs:
    """The inputs `config.seed_inputs` names (of `config.SEED_INPUTS`), made in `out` where missing; a failure is one
    line on stdout."""
    made = {}
    for name, file, make in (("calibrate", PROFILE, _calibrate), ("microbench", MICROBENCH, _microbench)):
        if name not in config.seed_inputs:
            continue
        path = out / file
        if not path.exists():
            try:
                make(config, path, progress)
            except DraftlabError as exc:
                print(f"study: no {name} for the seeds' findings ({exc})")
                continue
            print(f"study: {name} for the seeds' findings -> {path}")
        made[name] = path
    return SeedInputs(made.get("calibrate"), made.get("microbench"))


def _calibrate(config: SweepConfig, path: Path, progress: bool) -> None:
    """The first target's profile with the grid's drafts that run on its engine."""
    from draftlab.files.datasets import load_prompts
    from draftlab.perf.calibrate import CalibrationSettings, calibrate
    from draftlab.registry import build_drafter

    target = _load_target(config)
    drafts = []
    for spec in config.drafters:
        try:
            build_drafter(spec, target, target_backend(config.targets[0], config.backend)[0])
        except DraftlabError:
            continue  # a draft that does not run on this engine: the study skipped its cells too
        drafts.append(spec)
    if not drafts:
        raise DraftlabError(f"no draft of the grid runs on {config.targets[0]}")
    settings = CalibrationSettings(max(config.ks), max(config.max_new_tokens // 2, 8), 3,
                                   target_backend(config.targets[0], config.backend)[0])
    per_dataset = -(-CALIBRATION_PROMPTS // len(config.datasets))  # each workload's acceptance in the profile
    prompts = [p for dataset in config.datasets for p in load_prompts(dataset, per_dataset, config.skip)]
    calibrate(target, drafts, prompts, settings, progress=progress).save(path)


def _microbench(config: SweepConfig, path: Path, progress: bool) -> None:
    """Depth vs width in the shape of the grid's first model draft (else the first target's)."""
    from transformers import AutoConfig

    from draftlab.design import microbench

    timings = microbench.run(AutoConfig.from_pretrained(_shape_source(config)), steps=10, progress=progress,
                             series=MICROBENCH_SERIES)
    microbench.save(timings, path.parent)


def _load_target(config: SweepConfig):
    from draftlab.models import load_model

    backend, source = target_backend(config.targets[0], config.backend)
    target = load_model(source, device=config.device, dtype=config.dtype, backend=backend)
    target.name = config.targets[0]
    return target


def _shape_source(config: SweepConfig) -> Path:
    """A folder holding the config.json of the grid's first model draft, or of the first target: read from a GGUF's
    metadata (no weights converted)."""
    from draftlab.api import parse_drafter_spec
    from draftlab.backends.gguf import describe_gguf
    from draftlab.drafters.model_spec import gguf_draft
    from draftlab.files import assets
    from draftlab.models import gguf_path, is_gguf, resolve_directory

    models = [plan.model for plan in map(parse_drafter_spec, config.drafters) if plan.kind == "model"]
    source = gguf_draft(models[0]) if models else target_backend(config.targets[0], config.backend)[1]
    if is_gguf(source):
        return describe_gguf(gguf_path(source), assets.cache_dir())
    return resolve_directory(source)
