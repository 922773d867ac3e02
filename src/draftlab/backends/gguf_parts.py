"""What a one-layer draft borrows from a target that runs in llama.cpp, read from the target's own GGUF.

An EAGLE-3 draft embeds the token it reads with the target's input embeddings, turns its output into logits with
the target's LM-head rows of its vocabulary and rotates its queries and keys as the target does
(`draftlab.drafters.files.target_parts` takes them from a torch target). For a GGUF target they come from the file
llama.cpp runs: its `token_embd.weight` and `output.weight` (the tied embeddings when it has none), de-quantized
by gguf-py to the very values llama.cpp's kernels read, and the rotary tables of the model type's own
transformers class, built from the GGUF's config (no weights loaded into torch).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from draftlab.backends.gguf_derive import read_gguf
from draftlab.errors import DraftlabError

EMBEDDINGS = "token_embd.weight"
HEAD = "output.weight"


def gguf_target_parts(path: Path, config, vocab_map: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input embeddings [V, D], the LM-head rows of `vocab_map` [V', D] and the rotary tables cos, sin [P, hd]
    over the context length, fp32, of the GGUF model at `path` (its HF `config`)."""
    reader, _ = read_gguf(path, "a draft's target parts")
    tensors = {t.name: t for t in reader.tensors}
    if EMBEDDINGS not in tensors:
        raise DraftlabError(f"GGUF {path} holds no {EMBEDDINGS}: no embeddings for a draft to read")
    embed = dequantized(tensors[EMBEDDINGS], None)  # [V, D]
    rows = vocab_map.to(torch.int64).numpy()
    head = embed[torch.from_numpy(rows)] if HEAD not in tensors else dequantized(tensors[HEAD], rows)  # [V', D]
    cos, sin = rotary_tables(config)
    return embed, head, cos, sin


def dequantized(tensor, rows: np.ndarray | None) -> torch.Tensor:
    """A 2D GGUF tensor's rows (all, or `rows`) as fp32 [n, D]."""
    from gguf.quants import dequantize

    data = tensor.data if rows is None else tensor.data[rows]  # [n, bytes of a row] (quantized) or [n, D]
    try:
        values = dequantize(np.ascontiguousarray(data), tensor.tensor_type)
    except NotImplementedError as exc:
        raise DraftlabError(f"gguf-py cannot de-quantize {tensor.name} ({tensor.tensor_type.name}): {exc}") from exc
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))


def rotary_tables(config) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [P, hd] of the model type's own rotary embedding over `config.max_position_embeddings`."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # the model's classes, no weights
        skeleton = AutoModelForCausalLM.from_config(config)
    rotary = type(skeleton.model.rotary_emb)(config=config)
    positions = torch.arange(config.max_position_embeddings)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, hd]
    return cos[0], sin[0]
