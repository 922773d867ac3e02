"""Hugging Face `generate` as a reference: plain greedy/sampling and assisted generation (AsG).

HF reads the assistant's K from the assistant model's own generation config,
so `assisted_kwargs` gives our draft module (built or loaded by draftlab for
this purpose, never the user's target) a config with a constant K and no
confidence cut-off: the same fixed-K drafting our engine does.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from draftlab.registry import DraftPlan
from draftlab.errors import DraftlabError
from draftlab.engine import GenerationConfig
from draftlab.models import LoadedModel
from draftlab.sampling import SamplingConfig


def assisted_kwargs(plan: DraftPlan, draft: LoadedModel | None, k: int) -> dict:
    """generate() arguments for HF's counterpart of a drafter: assistant model or prompt lookup."""
    from transformers import GenerationConfig

    if plan.kind == "ngram":
        return {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": plan.ngram[1]}
    if plan.kind in ("tree", "merged"):
        raise DraftlabError("HF assisted generation drafts chains only; a token tree has no counterpart there")
    if plan.kind == "staged":
        raise DraftlabError("HF assisted generation has no staged drafting; run the inner draft alone there")
    if draft is None or draft.vocab_size != draft.model.config.vocab_size:
        raise DraftlabError(
            f"{plan.kind} draft {draft.name if draft else ''} has no HF assisted-generation counterpart "
            "(HF needs a draft with the target's full vocabulary)"
        )
    draft.model.generation_config = GenerationConfig(
        num_assistant_tokens=k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
    )
    return {"assistant_model": draft.model}


def hf_generate(
    target: LoadedModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos: Sequence[int],
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = GenerationConfig.seed,
    **assist,
) -> tuple[list[int], float]:
    """New token ids and wall seconds of one HF generate call (batch 1)."""
    input_ids = torch.tensor([list(prompt_ids)], device=target.device)
    options = {"do_sample": False}
    if not sampling.greedy:
        # top_k=0 switches HF's top-k off explicitly (None would fall back to the model's default, often 50).
        options = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
                   "top_p": sampling.top_p}
        torch.manual_seed(seed)  # HF samples from the global generator
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
            eos_token_id=list(eos) or None, pad_token_id=eos[0] if eos else None, **options, **assist,
        )
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    return out[0, input_ids.shape[1]:].tolist(), time.perf_counter() - start
