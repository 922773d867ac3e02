"""Every command-line value checked once, before any command runs or touches a file.

Each flag is checked by the configuration object that owns it where one
exists (`SamplingConfig`, `FixedK`, `ModelSpec`'s dtype and device, the
backend registry); the rest are plain bounds. A bad value raises
`DraftlabError`, which `main` prints as one line with exit status 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from draftlab.errors import DraftlabError


def _at_least(minimum: float) -> Callable[[str, object], None]:
    def check(flag: str, value) -> None:
        if not value >= minimum or value == float("inf"):  # NaN compares false
            raise DraftlabError(f"{flag} must be a finite number >= {minimum:g}, got {value}")
    return check


def _positive(flag: str, value) -> None:
    if not value > 0 or value == float("inf"):
        raise DraftlabError(f"{flag} must be a finite number > 0, got {value}")


def _text(flag: str, value) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise DraftlabError(f"{flag} is not valid UTF-8 text") from None


def _output(flag: str, value) -> None:
    """An output path: no part of the way to it may be a file."""
    path = Path(value)
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise DraftlabError(f"{flag} {path}: {parent} is a file, not a directory")


def _new_draft_dir(flag: str, value) -> None:
    _output(flag, value)
    if Path(value).exists() and not Path(value).is_dir():
        raise DraftlabError(f"{flag} {value} is a file; give a directory for the adapted draft")


def _k(flag: str, value) -> None:
    """A K >= 1, or (draftlab serve) auto."""
    from draftlab.decoding.policy import FixedK

    if value == "auto":
        return
    if isinstance(value, str) and not value.isdigit():
        raise DraftlabError(f"{flag} takes a number >= 1 or auto, not {value!r}")
    FixedK(int(value))


def _dtype(flag: str, value) -> None:
    from draftlab.models import check_dtype_name

    check_dtype_name(value)


def _device(flag: str, value) -> None:
    from draftlab.models import check_device

    check_device(value)


def _backend(flag: str, value) -> None:
    from draftlab.backends import check_backend_name

    check_backend_name(value)


def _stops(flag: str, value) -> None:
    if any(not s for s in value):
        raise DraftlabError(f"{flag} must not be empty: give the text that ends generation")


def _drafter(flag: str, value) -> None:
    from draftlab.registry import parse_drafter_spec

    for spec in [value] if isinstance(value, str) else value:
        parse_drafter_spec(spec)


def _existing_file(flag: str, value) -> None:
    path = Path(value)
    if path.is_dir():
        raise DraftlabError(f"{flag}: {path} is a directory, not a file")
    if path.suffix and not path.is_file():  # a file name, not a bundled dataset or model name
        raise DraftlabError(f"{flag}: file not found: {path}")


CHECKS: dict[str, Callable[[str, object], None]] = {
    "threads": _at_least(1),
    "skip": _at_least(0),
    "limit": _at_least(1),
    "warmup": _at_least(0),
    "max_new_tokens": _at_least(1),
    "k": _k,
    "k_max": _k,
    "repeats": _at_least(1),
    "steps": _at_least(1),
    "context": _at_least(1),
    "budget": _positive,
    "checkpoint_every": _positive,
    "lr": _positive,
    "seq_len": _at_least(2),
    "batch_size": _at_least(1),
    "vocab": _at_least(2),
    "generate": _at_least(0),
    "mmlu": _at_least(0),
    "search": _at_least(1),
    "goal": _positive,
    "positions": _at_least(1),
    "samples": _at_least(20),
    "dtype": _dtype,
    "device": _device,
    "backend": _backend,
    "stop": _stops,
    "drafter": _drafter,
    "drafters": _drafter,
    "drafts": _drafter,
    "prompts": _existing_file,
    "prompt": _text,
    "out": _output,
    "db": _output,
    "adapt_save": _new_draft_dir,
    "race_after": _at_least(0),
    "preflight_timeout": _at_least(0),
    "baseline_every": _at_least(0),
    "profile": _existing_file,
    "config": _existing_file,
}


def check_args(args: argparse.Namespace) -> None:
    """Check every flag the command has (values left unset are not checked)."""
    for name, check in CHECKS.items():
        value = getattr(args, name, None)
        if value is not None:
            check("--" + name.replace("_", "-"), value)
    if getattr(args, "temperature", None) is not None:
        from draftlab.decoding.sampling import SamplingConfig

        SamplingConfig(args.temperature, args.top_k, args.top_p)
