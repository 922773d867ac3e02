"""Hugging Face `generate` as a reference: plain greedy/sampling and assisted generation (AsG).

HF reads the assistant's K from the assistant model's own generation config,
so `hf_assist` describes the config that gives a constant K and no confidence
cut-off (the same fixed-K drafting our engine does), and `hf_generate` lends it
to the assistant model for that one call and then puts the model's own back:
no loaded model keeps a changed config.

Its `METHODS` in a study (`contenders.contract`): HF's plain `generate` and its assisted generation (AsG).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from draftlab.contenders.contract import ContenderSource, Method
from draftlab.registry import DraftPlan, parse_drafter_spec
from draftlab.errors import DraftlabError
from draftlab.engine import GenerationConfig, GenerationResult, check_room, tokens_result
from draftlab.models import LoadedModel


@dataclass(frozen=True)
class HFAssist:
    """HF's counterpart of a drafter at K: prompt lookup, or an assistant model drafting K tokens a step."""

    k: int
    ngram_max: int = 0  # prompt lookup's longest n-gram; 0: an assistant model drafts instead
    assistant: torch.nn.Module | None = None

    def generate_args(self) -> dict:
        """The arguments `generate` takes for it."""
        if self.assistant is None:
            return {"prompt_lookup_num_tokens": self.k, "max_matching_ngram_size": self.ngram_max}
        return {"assistant_model": self.assistant}

    def assistant_config(self):
        """The generation config HF reads from the assistant: K tokens a step, always, no confidence cut-off."""
        from transformers import GenerationConfig as HFGenerationConfig

        return HFGenerationConfig(num_assistant_tokens=self.k, num_assistant_tokens_schedule="constant",
                                  assistant_confidence_threshold=0.0)


def hf_assist(plan: DraftPlan, draft: LoadedModel | None, k: int) -> HFAssist:
    """HF's counterpart of a drafter, or a clear error when HF has none (trees, staged, cut vocabularies).

    A stand-alone model draft with a cut vocabulary (`draftlab design cut`) runs there whole: HF's assistant
    cannot cut its head, so AsG measures the same draft model without the cut.
    """
    if plan.kind == "ngram":
        return HFAssist(k, ngram_max=plan.ngram[1])
    if plan.kind in ("tree", "merged"):
        raise DraftlabError("HF assisted generation drafts chains only; a token tree has no counterpart there")
    if plan.kind == "staged":
        raise DraftlabError("HF assisted generation has no staged drafting; run the inner draft alone there")
    if plan.kind == "adapt":
        raise DraftlabError("HF assisted generation has no online adaptation; run the static draft there")
    if plan.kind == "suffix":
        raise DraftlabError("HF assisted generation has no suffix decoding; its prompt lookup is ngram's counterpart")
    if draft is None or draft.vocab_size != draft.model.config.vocab_size:
        raise DraftlabError(
            f"{plan.kind} draft {draft.name if draft else ''} has no HF assisted-generation counterpart "
            "(HF needs a draft with the target's full vocabulary)"
        )
    return HFAssist(k, assistant=draft.model)


@contextmanager
def lent_assistant_config(assist: HFAssist | None) -> Iterator[None]:
    """Give the assistant model the config HF reads K from for the duration of one call, then restore its own."""
    if assist is None or assist.assistant is None:
        yield
        return
    own = assist.assistant.generation_config
    assist.assistant.generation_config = assist.assistant_config()
    try:
        yield
    finally:
        assist.assistant.generation_config = own


def hf_generate(target: LoadedModel, prompt_ids: Sequence[int], config: GenerationConfig,
                assist: HFAssist | None = None) -> list[int]:
    """New token ids of one HF generate call (batch 1) of `config`'s length, sampling, seed and end-of-sequence ids;
    `assist`: assisted generation. Timed only through `HFGenerate` in the measurement loop."""
    sampling, eos = config.sampling, config.eos_token_ids
    input_ids = torch.tensor([list(prompt_ids)], device=target.device)
    options = {"do_sample": False}
    if not sampling.greedy:
        # top_k=0 switches HF's top-k off explicitly (None would fall back to the model's default, often 50).
        options = {"do_sample": True, "temperature": sampling.temperature, "top_k": sampling.top_k,
                   "top_p": sampling.top_p}
        torch.manual_seed(config.seed)  # HF samples from the global generator
    assisted = assist.generate_args() if assist else {}
    with torch.inference_mode(), lent_assistant_config(assist):
        out = target.model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=config.max_new_tokens,
            eos_token_id=list(eos) or None, pad_token_id=eos[0] if eos else None, **options, **assisted,
        )
    if target.device.type == "cuda":
        torch.cuda.synchronize(target.device)
    return out[0, input_ids.shape[1]:].tolist()


@dataclass(frozen=True)
class HFGenerate:
    """HF `generate` (plain, or assisted generation with `assist`) as a measurement contender
    (`draftlab.measure.Contender`): it times only the whole call. `generate` cannot start from a prefill it did
    not compute, so each call prefills; its prefill is timed apart as a `generate` of one new token (plain and
    assisted calls share it), which the loop takes off each call."""

    target: LoadedModel
    eos: tuple[int, ...]
    assist: HFAssist | None = None
    times_prefill = False
    reuses_prefill = False
    prefill_key = "hf"

    def prefill(self, prompt_ids: list[int]) -> None:
        """HF's prefill of the prompt, as `generate` computes it: one new token (timed by the loop)."""
        hf_generate(self.target, prompt_ids, GenerationConfig(1, eos_token_ids=self.eos))

    def take_prefill(self, prompt_ids: list[int]) -> None:
        """Nothing: `generate` keeps no cache between calls (each run prefills again)."""

    def run(self, prompt_ids: list[int], settings) -> GenerationResult:
        """One `generate` call with the loop's settings; a prompt that does not fit the context is refused as
        draftlab's engine refuses it (HF's would run past the context with a warning)."""
        check_room(len(prompt_ids), settings.max_new_tokens, self.target.context_length)
        config = GenerationConfig(settings.max_new_tokens, settings.sampling, settings.seed, eos_token_ids=self.eos)
        tokens = hf_generate(self.target, prompt_ids, config, self.assist)
        return tokens_result(prompt_ids, tokens)

    def forgetful(self) -> "HFGenerate":
        """Itself: HF keeps nothing across calls."""
        return self


def assist_of(source: ContenderSource, drafter: str, k: int) -> HFAssist:
    """HF's counterpart of a study's drafter at K (a clear error where HF has none)."""
    return hf_assist(parse_drafter_spec(drafter), source.decoder(drafter, k).draft_model, k)


def _generate(source: ContenderSource, cell, _companions: tuple) -> HFGenerate:
    return HFGenerate(source.target, source.eos)


def _assisted(source: ContenderSource, cell, _companions: tuple) -> HFGenerate:
    return HFGenerate(source.target, source.eos, assist_of(source, cell.drafter, cell.k))


HF = Method("hf", "HF generate", 2, "HF generate", plain=True, reference="ar", times_prefill=False, peer=True,
            torch_only=True, swept=False, build=_generate)
ASG = Method("asg", "AsG", 4, "HF generate", plain=False, reference="hf", times_prefill=False, peer=True,
             torch_only=True, assisted=True, build=_assisted)
METHODS = (HF, ASG)
