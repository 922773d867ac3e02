"""draftlab: lossless speculative decoding, and the evidence to choose draft and K."""

from draftlab.api import SpeculativeDecoder, encode_prompt, parse_drafter_spec
from draftlab.drafters import Drafter, ModelDrafter, NGramDrafter, NoDrafter, build_layer_draft
from draftlab.drafters.adapt import AdaptingDrafter, AdaptSettings
from draftlab.drafters.suffix import SuffixCache, SuffixDrafter, SuffixOptions
from draftlab.decoding.step import Proposal
from draftlab.engine import GenerationConfig, GenerationResult, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.decoding.metrics import GenerationStats
from draftlab.models import LoadedModel, ModelSpec, load_model
from draftlab.decoding.policy import DraftLengthPolicy, DynamicK, FixedK
from draftlab.decoding.sampling import SamplingConfig

__all__ = [
    "AdaptingDrafter", "AdaptSettings", "Drafter", "DraftLengthPolicy", "DraftlabError", "DynamicK", "FixedK", "GenerationConfig",
    "GenerationResult", "GenerationStats", "LoadedModel", "ModelDrafter", "ModelSpec", "NGramDrafter",
    "NoDrafter", "Proposal", "SamplingConfig", "SpeculativeDecoder", "SpeculativeEngine", "SuffixCache",
    "SuffixDrafter", "SuffixOptions",
    "build_layer_draft", "encode_prompt", "load_model", "parse_drafter_spec",
]
__version__ = "0.49.0"
