"""Files draftlab writes and reads back: whole or not at all, and never code.

Every file draftlab rewrites goes to a temporary name unique to the writer (two processes never share one) in the
same directory, is flushed to disk, then renamed over the old file: a kill leaves the old file or the new one,
never half of either. Tensor files (sweep states, training checkpoints, design caches) are read with torch's
`weights_only` loader, which builds tensors, numbers, strings and containers and refuses anything else: a file
planted in a results or draft directory cannot run code when draftlab reads it.
"""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from draftlab.errors import DraftlabError


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Replace `path` with `data` (text as UTF-8) in one rename, through a temporary name unique to this writer."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def private_dir(out: Path) -> Path:
    """An empty directory beside `out` that only this process writes, to be published as `out` (`publish_dir`)."""
    partial = out.with_name(f".{out.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # a killed run's, under a process id used again
    partial.mkdir(parents=True)
    return partial


def publish_dir(partial: Path, out: Path) -> Path:
    """The finished directory `partial` renamed to `out` in one step; where another process published `out` first
    (the same work, done at once), theirs is kept and ours removed."""
    try:
        partial.replace(out)
    except OSError:
        if not out.is_dir():
            raise
        shutil.rmtree(partial, ignore_errors=True)
    return out


def save_tensors(data: Any, path: str | Path) -> None:
    """`torch.save` of tensors, numbers, strings and containers, written atomically."""
    buffer = io.BytesIO()
    torch.save(data, buffer)
    write_atomic(path, buffer.getvalue())


def load_tensors(path: str | Path, what: str) -> Any:
    """What `save_tensors` wrote, read without running code; a one-line error names `what` and the file otherwise."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises UnpicklingError, RuntimeError, EOFError, ... for foreign or torn files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DraftlabError(f"cannot read {what} {path}: {first[:200]}; delete it to start over") from exc
