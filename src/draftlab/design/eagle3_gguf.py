"""EAGLE-3 drafts as GGUF, for `llama-server -md DRAFT.gguf --spec-type draft-eagle3`.

llama.cpp's converter (`convert_hf_to_gguf.py DRAFT_DIR --target-model-dir TARGET_DIR`) reads the engines'
checkpoint (`draftlab.drafters.eagle3_checkpoint`) and the target's tokenizer and config; `write_target_dir` writes
those two from the target draftlab loaded (a GGUF target has no HF directory). `to_gguf` runs the converter of the
llama.cpp that draftlab's llama-server is built from (kept in the build by `scripts/build-llama-cpp.sh`).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from draftlab.errors import DraftlabError
from draftlab.contenders.llama_server import BUILD_HINT, build_dir
from draftlab.models import LoadedModel

CONVERTER_DIR = "convert"  # in the llama.cpp build: convert_hf_to_gguf.py, conversion/, gguf-py/


def write_target_dir(target: LoadedModel, out: str | Path) -> Path:
    """The target's config.json and tokenizer files in `out`: what llama.cpp's converter reads from
    `--target-model-dir` (no weights)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target.model.config.save_pretrained(out)
    target.tokenizer.save_pretrained(out)
    return out


def converter() -> Path:
    """The llama.cpp converter kept beside the llama-server binary."""
    script = build_dir() / CONVERTER_DIR / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise DraftlabError(f"llama.cpp's converter not found at {script}; {BUILD_HINT}")
    return script


def to_gguf(checkpoint: str | Path, target_dir: str | Path, out_file: str | Path, outtype: str = "bf16") -> Path:
    """Convert an EAGLE-3 checkpoint to GGUF with llama.cpp's converter (`--target-model-dir`); the GGUF's path."""
    script = converter()
    out_file = Path(out_file)
    partial = out_file.with_name(out_file.name + ".partial")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent / "gguf-py"),
                                                        os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    command = [sys.executable, str(script), str(checkpoint), "--target-model-dir", str(target_dir),
               "--outtype", outtype, "--outfile", str(partial)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise DraftlabError(f"llama.cpp's converter failed on {checkpoint}: {last}")
    partial.replace(out_file)
    return out_file
