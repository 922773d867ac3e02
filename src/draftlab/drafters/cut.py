"""Stand-alone drafts with a cut vocabulary: a separate small model whose LM head keeps only frequent tokens.

A small model of the target's family spends a large share of each token on
its LM head when the vocabulary is large (Qwen2.5-Coder 0.5B: 151,936 x 896,
over a quarter of its weights). Keeping only the rows of the tokens that
actually occur (as FR-Spec does) makes every draft token cheaper and loses
only the proposals of rare tokens; verification is unchanged, so decoding
stays lossless (a cut draft's probabilities are zero outside its rows, and
the rejection rule handles that like any other draft distribution).

The directory names the model and holds only the kept token ids:

    draftlab_draft.json   {"format": "draftlab-cut-draft", "version": 1, "model": NAME_OR_PATH,
                           "target": ..., "target_vocab_size": V, "vocab_size": V', "made": {...}}
    weights.safetensors   vocab_map [V'] (target token ids, ascending)

`draftlab design cut` writes one; the registry loads it as `model:DIR`: on torch the backend computes the kept
rows only (`head_rows`); on llama.cpp the draft runs from a GGUF whose head holds only those rows
(`draftlab.backends.gguf_head`), in its file's weight type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from draftlab.backends.gguf import loads_trimmed_heads
from draftlab.backends.gguf_head import derive_trimmed_head
from draftlab.backends.numerics import checked_rows
from draftlab.drafters.files import RECORD, WEIGHTS, check_target_vocab, read_draft_files
from draftlab.drafters.model_spec import gguf_draft
from draftlab.errors import DraftlabError
from draftlab.files import assets
from draftlab.models import LoadedModel, ModelSpec, dtype_name, eos_ids, gguf_path, load_model

FORMAT = "draftlab-cut-draft"


@dataclass
class CutDraft:
    """The draft model to load and the target ids of the head rows it keeps."""

    model: str  # short name, .gguf path or HF directory of the stand-alone draft
    vocab_map: torch.Tensor  # [V'] target token ids, ascending
    made: dict = field(default_factory=dict)


def save_cut_draft(draft: CutDraft, out: str | Path, target: LoadedModel) -> Path:
    """Write the record and the kept token ids."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"vocab_map": draft.vocab_map.to(torch.int64).contiguous()}, str(out / WEIGHTS))
    record = {"format": FORMAT, "version": 1, "model": draft.model, "target": target.name,
              "target_vocab_size": target.vocab_size, "vocab_size": len(draft.vocab_map), "made": draft.made}
    (out / RECORD).write_text(json.dumps(record, indent=2))
    return out


def read_cut_draft(path: str | Path, target: LoadedModel) -> CutDraft:
    """The record of a cut draft, checked against `target`'s vocabulary."""
    record, state = read_draft_files(path, FORMAT)
    check_target_vocab(path, record, target.vocab_size, target.name)
    vocab_map = state.get("vocab_map")
    if not isinstance(record.get("model"), str) or vocab_map is None:
        raise DraftlabError(f"cut draft {path} lacks its model name or its vocab_map; rebuild it")
    try:
        vocab_map = checked_rows(vocab_map, target.vocab_size)
    except DraftlabError as exc:
        raise DraftlabError(f"cut draft {path} keeps token ids outside {target.name}'s vocabulary; rebuild it") from exc
    return CutDraft(record["model"], vocab_map, record.get("made", {}))


def ranked_cut(model: str, size: int, target: LoadedModel) -> CutDraft:
    """A cut draft of `model` keeping the `size` lowest token ids and the target's end-of-sequence ids (a draft
    option: `model:NAME,head=N`). A BPE vocabulary numbers its tokens in merge order, so low ids are the tokens its
    own training corpus held most often; `draftlab design cut` ranks them by a text's counts instead."""
    if size > target.vocab_size:
        raise DraftlabError(f"a draft head of {size} rows is larger than {target.name}'s vocabulary of "
                            f"{target.vocab_size}")
    kept = sorted(set(range(size)) | {i for i in eos_ids(target) if i < target.vocab_size})
    return CutDraft(model, torch.tensor(kept, dtype=torch.int64), {"method": "ranked", "head": size})


def load_cut_model(draft: CutDraft, target: LoadedModel, dtype: torch.dtype | None = None) -> LoadedModel:
    """The stand-alone draft model on the target's device, in `dtype` (None: the target's)."""
    return load_model(ModelSpec(draft.model, device=str(target.device), dtype=dtype_name(dtype or target.dtype)))


def load_cut_gguf(draft: CutDraft, target: LoadedModel) -> LoadedModel:
    """The stand-alone draft in the target's llama.cpp engine, from its GGUF (`gguf_draft`: a short name's pure
    Q4_0) with the head cut to the kept rows, derived once; repacked, as model drafts are."""
    if not loads_trimmed_heads():
        raise DraftlabError("this build of llama.cpp cannot load a cut draft's trimmed head; draftlab's build can "
                            "(scripts/build-llama-cpp.sh, run by ./run.sh)")
    path = derive_trimmed_head(gguf_path(gguf_draft(draft.model)), draft.vocab_map, assets.cache_dir())
    loaded = load_model(ModelSpec(str(path)), backend=target.engine.backend, repack=True)
    loaded.name = gguf_draft(draft.model)
    return loaded
