"""Training and calibration text for draft design, as token sequences of the target's tokenizer.

Three sources: prompt sets (each prompt as the engine sees it, through the
chat template when it applies), the target's own greedy continuations of
those prompts (what a draft must really predict), and any user text file
(.txt: one document per blank-line-separated block; .jsonl: a `text` or
`prompt` field per line).
"""

from __future__ import annotations

import json
from pathlib import Path

from tqdm import tqdm

from draftlab.api import SpeculativeDecoder, encode_prompt
from draftlab.datasets import load_prompts
from draftlab.errors import DraftlabError
from draftlab.models import LoadedModel


def prompt_sequences(target: LoadedModel, datasets: list[str], limit: int | None) -> list[list[int]]:
    """Encoded prompts of the given sets; 'NAME:N' takes N prompts of that set instead of `limit`."""
    out = []
    for entry in datasets:
        name, _, count = entry.rpartition(":") if entry.rpartition(":")[2].isdigit() else (entry, "", "")
        for p in load_prompts(name, int(count) if count else limit):
            out.append(encode_prompt(target.tokenizer, p.text, p.chat))
    return out


def with_generations(target: LoadedModel, prompts: list[list[int]], count: int, max_new_tokens: int,
                     progress: bool = True) -> list[list[int]]:
    """The first `count` prompts followed by the target's greedy continuation (fast n-gram-drafted decoding)."""
    decoder = SpeculativeDecoder.from_names(target, drafter="ngram", k=4)
    out = []
    for ids in tqdm(prompts[:count], desc="target generations", unit="prompt", disable=not progress):
        out.append(ids + decoder.generate(ids, max_new_tokens=max_new_tokens).token_ids)
    return out


def file_sequences(target: LoadedModel, path: str | Path) -> list[list[int]]:
    """Documents of a user text or JSONL file, tokenized without a chat template."""
    path = Path(path)
    if not path.is_file():
        raise DraftlabError(f"corpus file not found: {path}")
    if path.suffix == ".jsonl":
        texts = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if "text" not in row and "prompt" not in row:
                    raise DraftlabError(f"{path}:{number}: expected a 'text' or 'prompt' field")
                texts.append(row.get("text") or row["prompt"])
    else:
        texts = [block for block in path.read_text(encoding="utf-8").split("\n\n") if block.strip()]
    return [list(target.tokenizer(t)["input_ids"]) for t in texts]


def gather(target: LoadedModel, datasets: list[str], limit: int | None, generate: int, max_new_tokens: int,
           corpus: str | None = None, progress: bool = True) -> list[list[int]]:
    """Every source together: generations first (they matter most), then the other prompts, then the file."""
    prompts = prompt_sequences(target, datasets, limit) if datasets else []
    sequences = with_generations(target, prompts, generate, max_new_tokens, progress) if generate else []
    sequences += prompts[generate:]
    if corpus:
        sequences += file_sequences(target, corpus)
    if not sequences:
        raise DraftlabError("no training text: give --datasets, --generate or --corpus")
    return sequences
