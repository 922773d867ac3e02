"""Draft sources, one file each, behind the `Drafter` protocol (base.py)."""

from draftlab.drafters.base import BlindDrafter, Drafter, NoDrafter, PerRequest
from draftlab.drafters.layers import build_layer_draft, format_layers
from draftlab.drafters.standalone import ModelDrafter, check_compatible
from draftlab.drafters.ngram import NGramDrafter
from draftlab.drafters.staged import StagedDrafter
from draftlab.drafters.suffix import SuffixDrafter

__all__ = ["BlindDrafter", "Drafter", "ModelDrafter", "NGramDrafter", "NoDrafter", "PerRequest", "StagedDrafter",
           "SuffixDrafter", "build_layer_draft", "check_compatible", "format_layers"]
