"""Training and calibration text for draft design, as token sequences of the target's tokenizer.

Three sources: prompt sets (each prompt as the engine sees it, through the
chat template when it applies), the target's own greedy continuations of
those prompts (what a draft must really predict; generated in bf16 batches),
and any user text file
(.txt: one document per blank-line-separated block; .jsonl: a `text` or
`prompt` field per line).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from draftlab.api import eos_ids, prompt_ids
from draftlab.files.datasets import load_prompts
from draftlab.errors import DraftlabError
from draftlab.models import DTYPES, LoadedModel, batch_dtype_name
from draftlab.progress import track
from draftlab.files.safeio import load_tensors, save_tensors

TEXT = "text.pt"


def prompt_sequences(target: LoadedModel, datasets: list[str], limit: int | None) -> list[list[int]]:
    """Encoded prompts of the given sets.

    'NAME:N' takes the first N prompts of that set (round-robin order) instead of `limit`;
    'NAME:A-B' takes prompts A..B-1, e.g. the next ones after an earlier draft's training text.
    """
    out = []
    for entry in datasets:
        name, skip, count = _selection(entry, limit)
        for p in load_prompts(name, count, skip=skip):
            out.append(prompt_ids(target.tokenizer, p))
    return out


def _selection(entry: str, limit: int | None) -> tuple[str, int, int | None]:
    """'NAME', 'NAME:N' or 'NAME:A-B' -> (name, skip, count)."""
    name, _, span = entry.rpartition(":")
    first, dash, last = span.partition("-")
    if not name or not first.isdigit() or (dash and not last.isdigit()):
        return entry, 0, limit
    if not dash:
        return name, 0, int(first)
    if int(last) <= int(first):
        raise DraftlabError(f"{entry}: the range A-B needs A < B")
    return name, int(first), int(last) - int(first)


def batched_generations(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, batch_size: int = 24,
                        dtype: torch.dtype | None = None, progress: bool = True) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation, generated in padded batches.

    For training text only: batches run in `dtype` (default: what `auto` picks on the target's
    device, bf16 where the hardware multiplies it natively, else fp32), so a continuation may differ
    from batch-1 decoding at near-ties. The target is not touched (a converted copy runs). Prompts are
    grouped by length to keep padding small.
    """
    if dtype is None:
        dtype = DTYPES[batch_dtype_name("auto", str(target.device))]
    model = copy.deepcopy(target.model).to(dtype).eval()
    pad = target.tokenizer.pad_token_id
    pad = pad if pad is not None else 0
    eos = set(eos_ids(target))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int] | None] = [None] * len(prompts)
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    for batch in track(batches, "target generations", unit="batch", disable=not progress):
        width = max(len(prompts[i]) for i in batch)
        ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in batch])  # [B, L]
        mask = (torch.arange(width)[None] >= torch.tensor([width - len(prompts[i]) for i in batch])[:, None]).long()
        with torch.inference_mode():
            generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=pad)[:, width:]  # [B, new]
        for i, row in zip(batch, generated.tolist()):
            out[i] = prompts[i] + _until_eos(row, eos)
    return out


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """Tokens up to and including the first end-of-sequence token."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


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
    sequences = batched_generations(target, prompts[:generate], max_new_tokens, progress=progress) if generate else []
    sequences += prompts[generate:]
    if corpus:
        sequences += file_sequences(target, corpus)
    if not sequences:
        raise DraftlabError("no training text: give --datasets, --generate or --corpus")
    return sequences


def cached_text(out: Path, target: LoadedModel, datasets: list[str], limit: int | None, generate: int,
                max_new_tokens: int, corpus: str | None = None, reuse: list[str] = (),
                progress: bool = True) -> list[list[int]]:
    """`gather`, cached in `out/text.pt` with its sources; a cache made from other sources is refused.

    reuse: earlier `text.pt` files (or the directories holding them) whose sequences are added,
    so that a new draft can train on an earlier draft's text without generating it again.
    """
    sources = {"datasets": list(datasets), "limit": limit, "generate": generate, "max_new_tokens": max_new_tokens,
               "corpus": corpus}
    if reuse:
        sources["reuse"] = [str(Path(r).resolve()) for r in reuse]
    path = Path(out) / TEXT
    if path.exists():
        cached = load_tensors(path, "the training text cache")
        if not isinstance(cached, dict) or cached.get("sources") != sources:
            raise DraftlabError(f"{path} was made from other text ({cached.get('sources')}); delete it or use "
                                "another --out")
        return cached["sequences"]
    sequences = gather(target, datasets, limit, generate, max_new_tokens, corpus, progress) if datasets or corpus else []
    for earlier in reuse:
        sequences += _reused(Path(earlier))
    if not sequences:
        raise DraftlabError("no training text: give --datasets, --corpus or --reuse-text")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors({"sources": sources, "sequences": sequences}, path)
    return sequences


def _reused(path: Path) -> list[list[int]]:
    """The sequences of an earlier text cache."""
    path = path / TEXT if path.is_dir() else path
    try:
        return list(load_tensors(path, "training text")["sequences"])
    except (KeyError, TypeError) as exc:
        raise DraftlabError(f"cannot reuse training text from {path} ({exc})") from exc
