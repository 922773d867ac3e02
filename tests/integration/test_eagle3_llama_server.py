"""EAGLE-3 drafts on llama-server: the checkpoint draftlab writes, converted by llama.cpp's own converter, loads with
`--spec-type draft-eagle3` and drafts (the server's draft_n_accepted above zero), on SmolLM2 (the shipped EAGLE-3
draft) and on the Qwen2.5-Coder 1.5B (a draft `draftlab design eagle3` trains here for a few steps: none ships for
it). llama-server's speculative decoding is equal to its plain decoding only up to rounding (its blocks round apart
from single rows), so outputs are compared and the differing ones counted, not asserted equal."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from draftlab.api import encode_prompt
from draftlab.design import eagle3_gguf
from draftlab.drafters import eagle3_checkpoint
from draftlab.drafters.eagle3 import load_eagle3_draft
from draftlab.drafters.shipped import shipped_draft
from draftlab.contenders.llama_server import LlamaServer, ServerConfig
from draftlab.measure import EncodedPrompt, RunSettings, run_once
from draftlab.models import gguf_path, load_model
from tests.integration.test_qwen_pair import pytestmark as qwen_marks

pytestmark = pytest.mark.integration
CONTEXT = 1024
TEXTS = ["Write a Python function that returns the n-th Fibonacci number iteratively.",
         "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n"]


def serve(target_gguf, draft_gguf, prompts, tmp_path, tokens: int = 48):
    """Each prompt through llama-server with the EAGLE-3 draft (K=3) and without; (speculative, plain) results."""
    results = []
    for config in (ServerConfig(target_gguf, spec_type="draft-eagle3", draft=draft_gguf, draft_n_max=3,
                                context=CONTEXT),
                   ServerConfig(target_gguf, context=CONTEXT)):
        with LlamaServer(config, tmp_path) as server:
            results.append([run_once("e3", server.contender(CONTEXT), p, RunSettings(tokens)) for p in prompts])
    return results


def encoded(target) -> list[EncodedPrompt]:
    return [EncodedPrompt(str(i), "code", encode_prompt(target.tokenizer, text)) for i, text in enumerate(TEXTS)]


@pytest.mark.slow
def test_the_shipped_smollm2_eagle3_draft_drafts_on_llama_server(binary, tmp_path):
    target = load_model("smollm2-135m", dtype="fp32")
    draft = load_eagle3_draft(shipped_draft("smollm2-135m", "eagle3"), target)
    checkpoint = eagle3_checkpoint.write_checkpoint(draft, target, tmp_path / "checkpoint")
    again = eagle3_checkpoint.read_checkpoint(checkpoint, target)  # the engines' checkpoint reads back as the same draft
    assert again.taps == draft.taps and torch.equal(again.vocab_map, draft.vocab_map)
    for name, tensor in again.layer.state_dict().items():
        assert torch.equal(tensor, draft.layer.state_dict()[name].to(torch.bfloat16).to(tensor.dtype)), name
    gguf = eagle3_gguf.to_gguf(checkpoint, eagle3_gguf.write_target_dir(target, tmp_path / "target"),
                                 tmp_path / "draft.gguf")
    speculative, plain = serve(gguf_path("smollm2-135m"), gguf, encoded(target), tmp_path)
    assert all(r.stats.drafted > 0 for r in speculative)
    assert sum(r.stats.accepted for r in speculative) > 0
    differing = sum(s.token_ids != p.token_ids for s, p in zip(speculative, plain))
    print(f"EAGLE-3 on llama-server (SmolLM2): accepted {[r.stats.accepted for r in speculative]} of drafted "
          f"{[r.stats.drafted for r in speculative]}; outputs differing from plain: {differing}/{len(plain)}")


@pytest.mark.slow
@pytest.mark.exhaustive
@next(m for m in qwen_marks if m.name == "skipif")  # the Qwen pair's: cached, or DRAFTLAB_QWEN=1 (CI)
def test_an_eagle3_draft_trained_here_drafts_for_the_qwen_target(binary, tmp_path):
    """`draftlab design eagle3 --gguf` end to end on the Qwen2.5-Coder 1.5B (a few steps on prompt text), then
    llama-server drafts with it: its qwen2 graph hands EAGLE-3 the layer inputs (scripts/build-llama-cpp.sh)."""
    out = tmp_path / "draft"
    command = [sys.executable, "-m", "draftlab.cli", "design", "eagle3", "--target", "qwen2.5-coder-1.5b", "--out",
               str(out), "--datasets", "humaneval:40", "--generate", "0", "--vocab", "4096", "--intermediate-size",
               "512", "--steps", "8", "--seq-len", "64", "--batch-size", "4", "--gguf", "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "eagle3: GGUF for llama-server" in done.stdout
    target = load_model("qwen2.5-coder-1.5b", backend="llamacpp")
    speculative, plain = serve(gguf_path("qwen2.5-coder-1.5b"), out / "eagle3-draft.gguf", encoded(target), tmp_path,
                               tokens=32)
    assert all(r.stats.drafted > 0 for r in speculative)
    assert sum(r.stats.accepted for r in speculative) > 0
    differing = sum(s.token_ids != p.token_ids for s, p in zip(speculative, plain))
    print(f"EAGLE-3 on llama-server (Qwen 1.5B): accepted {[r.stats.accepted for r in speculative]} of drafted "
          f"{[r.stats.drafted for r in speculative]}; outputs differing from plain: {differing}/{len(plain)}")
