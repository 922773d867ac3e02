"""Where each user-facing parameter's default lives: one place each.

The configuration objects own their defaults (`SamplingConfig`: temperature,
top_k, top_p; `GenerationConfig`: max_new_tokens, seed; `ModelSpec`: device,
dtype; `DraftSettings` below: drafter and K; `DEFAULT_BACKEND`), and the CLI,
the Python API, the bench, the sweep and the audit read them from there, so a
default is changed in one line. Validation lives in the same objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftlab.errors import DraftlabError

DEFAULT_BACKEND = "auto"  # draftlab's own forward where it applies, else transformers
# A draft model's weight type on llama.cpp when it is given by short name: pure Q4_0 runs llama.cpp's repacked
# kernels in every product (a shipped Q4_K_M draft token cost 2.6x one of pure Q4_0 on an AVX2 host).
DRAFT_WEIGHT_TYPE = "Q4_0_PURE"
SHORT_RUN_TOKENS = 48  # new tokens per prompt in studies and calibration runs (many short runs)


@dataclass(frozen=True)
class DraftSettings:
    """Which draft and how many tokens per step, when the user does not say."""

    drafter: str = "ngram"
    k: int = 4
    dynamic_k: bool = False

    def __post_init__(self) -> None:
        if self.k < 1:
            raise DraftlabError(f"K (draft tokens per step) must be >= 1, got {self.k}")
