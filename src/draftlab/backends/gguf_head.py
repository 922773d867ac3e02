"""Vocabulary-trimmed draft heads on llama.cpp: a draft model's GGUF whose LM head keeps only some tokens' rows.

A small draft of a large-vocabulary family spends a large share of each token on its LM head (Qwen2.5-Coder 0.5B:
151,936 x 896 of its ~494M multiply-adds a token). A cut draft (`draftlab design cut`, `draftlab.drafters.cut`)
keeps the rows of the most frequent tokens, as FR-Spec does; on torch the backend computes those rows only
(`head_rows`). llama.cpp computes whatever `output.weight` holds, so draftlab writes the draft's GGUF with an
`output.weight` of the kept rows only (from the tied embeddings when the file has no head of its own), each row
copied byte for byte, and `HEAD_ROWS_KEY` naming their number. The head is padded with zero rows to a multiple of
`PAD_ROWS`, so that llama.cpp repacks it like the whole head (its repacked kernels interleave 4 to 16 rows): each
kept logit is then the whole head's, bitwise, at that row's cost. draftlab's build of llama.cpp loads such a head
(scripts/llama-cpp/trimmed-head.patch) and writes each output's kept logits first in its row, -inf after them; the
backend reads the first rows and the drafter maps them to token ids (`vocab_map`). Verification is unchanged, so
decoding stays lossless.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from draftlab.backends.gguf import HEAD_ROWS_KEY
from draftlab.backends.gguf_derive import derive_once, derived_path, read_gguf, write_gguf
from draftlab.errors import DraftlabError

PAD_ROWS = 64  # a trimmed head's rows, rounded up to a multiple of this with zero rows (read by nobody)


def derive_trimmed_head(source: Path, vocab_map: torch.Tensor, cache_root: Path) -> Path:
    """The GGUF of `source` with an LM head of the rows `vocab_map` [V'] (token ids, ascending), written once and
    cached; the cached file's path."""
    rows = vocab_map.to(torch.int64).numpy()
    check_rows(rows, None, source)
    key = hashlib.sha256(rows.tobytes() + f"pad {PAD_ROWS}".encode()).hexdigest()[:12]  # what the file holds
    out = derived_path(source, "trimmed-heads", f"{source.stem}.head-{len(rows)}-{key}.gguf", cache_root)
    return derive_once(out, lambda partial: write_trimmed_head(source, rows, partial))


def write_trimmed_head(source: Path, rows: np.ndarray, out: Path) -> None:
    """Write `out`: `source` with `output.weight` cut to `rows` (of its own head, or of its tied embeddings)."""
    reader, arch = read_gguf(source, "a trimmed draft head")
    tensors = {t.name: t for t in reader.tensors}
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if head is None:
        raise DraftlabError(f"GGUF {source} holds neither output.weight nor token_embd.weight: no head to trim")
    check_rows(rows, head.data.shape[0], source)  # data: [V, n_embd] (floats) or [V, bytes of a row] (quantized)
    padded = np.zeros((-(-len(rows) // PAD_ROWS) * PAD_ROWS, *head.data.shape[1:]), dtype=head.data.dtype)
    padded[:len(rows)] = head.data[rows]  # [V' rounded up, ...]: zero bytes are zero weights in every ggml type
    kept = [(t.name, t.data, t.tensor_type) for t in reader.tensors if t.name != "output.weight"]
    kept.append(("output.weight", padded, head.tensor_type))
    write_gguf(reader, arch, out, lambda name, value: value, kept, extra={HEAD_ROWS_KEY: len(rows)})



def check_rows(rows: np.ndarray, vocab: int | None, source: Path) -> None:
    """Refuse token ids that are none, out of order, repeated or beyond the head's `vocab` rows (None: not read
    yet)."""
    if len(rows) == 0 or rows.min() < 0 or np.any(np.diff(rows) <= 0) or (vocab is not None and rows.max() >= vocab):
        within = f" within 0-{vocab - 1}" if vocab else ""
        raise DraftlabError(f"a trimmed head of {source.name} keeps distinct ascending token ids{within}")
