"""Options several commands share, declared once: the target and where it runs, the drafter, sampling, adaptation."""

from __future__ import annotations

import argparse

from draftlab.defaults import DEFAULT_BACKEND, DraftSettings
from draftlab.models import DEFAULT_TARGET, ModelSpec
from draftlab.contenders.preflight import TIMEOUT_S as PREFLIGHT_TIMEOUT_S
from draftlab.registry import SPEC_HELP
from draftlab.decoding.sampling import SamplingConfig


def add_target_args(parser: argparse.ArgumentParser) -> None:
    """--target, --device, --dtype, --backend, --threads."""
    parser.add_argument("--target", default=DEFAULT_TARGET, help="short name, .gguf file or HF model directory")
    parser.add_argument("--device", default=ModelSpec.device, help="cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default=ModelSpec.dtype,
                        help="auto (the dtype this host decodes fastest, timed once), fp32, bf16, fp16")
    parser.add_argument("--backend", default=DEFAULT_BACKEND,
                        help="auto | fast (draftlab's Llama forward) | hf (transformers) | llamacpp (the GGUF in llama.cpp)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def add_drafter_args(parser: argparse.ArgumentParser) -> None:
    """--drafter (every kind the registry knows) and --k."""
    parser.add_argument("--drafter", default=DraftSettings.drafter, help=SPEC_HELP)
    parser.add_argument("--k", type=int, default=DraftSettings.k, help="draft tokens per step (>= 1)")


def add_sampling_args(parser: argparse.ArgumentParser, temperature: float = SamplingConfig.temperature) -> None:
    """--temperature, --top-k, --top-p with SamplingConfig's defaults (a command may start hotter)."""
    parser.add_argument("--temperature", type=float, default=temperature, help="0 is greedy")
    parser.add_argument("--top-k", type=int, default=SamplingConfig.top_k, help="0: off")
    parser.add_argument("--top-p", type=float, default=SamplingConfig.top_p, help="1: off")


def add_adapt_args(parser: argparse.ArgumentParser) -> None:
    """--adapt [OPTIONS] and --adapt-save DIR: online adaptation of a feature draft or heads (`drafters.adapt`)."""
    parser.add_argument("--adapt", nargs="?", const="", default=None, metavar="OPTIONS",
                        help="let the feature draft or heads (designed, model:DIR, a tree of one) keep learning from "
                             "the target's hidden states while it decodes; OPTIONS e.g. lr=5e-4,every=32,steps=2")
    parser.add_argument("--adapt-save", default=None, metavar="DIR",
                        help="with --adapt: write the adapted draft here at the end (load it with model:DIR)")


def add_preflight_arg(parser: argparse.ArgumentParser) -> None:
    """--preflight-timeout: each engine first decodes a few tokens in a child process (`draftlab.contenders.preflight`)."""
    parser.add_argument("--preflight-timeout", type=float, default=PREFLIGHT_TIMEOUT_S, metavar="SECONDS",
                        help="each engine first decodes a few tokens in a child process; one that crashes or has not "
                             f"answered within this many seconds is left out, with one line (0: no preflight; "
                             f"default {PREFLIGHT_TIMEOUT_S})")
