"""Draft sources, one file each, behind the `Drafter` protocol (base.py)."""

from draftlab.drafters.base import BlindDrafter, Drafter, NoDrafter
from draftlab.drafters.layers import build_layer_draft, format_layers
from draftlab.drafters.model import ModelDrafter, check_compatible
from draftlab.drafters.ngram import NGramDrafter
from draftlab.drafters.staged import StagedDrafter

__all__ = ["BlindDrafter", "Drafter", "ModelDrafter", "NGramDrafter", "NoDrafter", "StagedDrafter", "build_layer_draft",
           "check_compatible", "format_layers"]
