"""The engines' EAGLE-3 checkpoint: the config keys and tensor names vLLM, SGLang and llama.cpp's converter read, a
round trip back into a draft that drafts the same, and foreign checkpoints refused with one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftlab.drafters import eagle3_checkpoint
from draftlab.drafters.anchored import AnchoredDrafter
from draftlab.drafters.eagle3 import new_eagle3_draft, save_eagle3_draft
from draftlab.errors import DraftlabError
from draftlab.registry import build_drafter
from tests.conftest import tiny_llama
from tests.test_eagle3 import PROMPTS, run

TAPS = (0, 1, 2)
# What the engines read (vLLM's LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM, SGLang's LlamaForCausalLMEagle3,
# llama.cpp's conversion/llama.py): the one-layer Llama config plus the EAGLE-3 keys, and these tensors.
CONFIG_KEYS = {"architectures", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
               "num_hidden_layers", "rms_norm_eps", "vocab_size", "draft_vocab_size", "target_hidden_size",
               "eagle_aux_hidden_state_layer_ids", "max_position_embeddings", "rope_theta", "hidden_act"}
TENSORS = {"fc.weight", "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
           "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
           "midlayer.self_attn.o_proj.weight", "midlayer.post_attention_layernorm.weight",
           "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
           "norm.weight", "lm_head.weight", "d2t", "t2d"}


@pytest.fixture()
def draft(tiny_target):
    draft = new_eagle3_draft(tiny_target, torch.arange(0, 64, 2), aux_layers=TAPS)
    draft.layer.to(torch.bfloat16).to(torch.float32)  # bf16-exact weights: the checkpoint stores bf16
    return draft


def test_the_checkpoint_has_the_engines_keys_and_shapes(tiny_target, draft, tmp_path):
    out = eagle3_checkpoint.write_checkpoint(draft, tiny_target, tmp_path / "ckpt")
    config = json.loads((out / "config.json").read_text())
    assert CONFIG_KEYS <= set(config) and config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["draft_vocab_size"] == 32 and config["vocab_size"] == 64
    assert config["eagle_aux_hidden_state_layer_ids"] == list(TAPS)
    assert eagle3_checkpoint.is_checkpoint(out)
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == TENSORS
    d = tiny_target.model.config.hidden_size
    assert tensors["fc.weight"].shape == (d, 3 * d)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * d  # q/k/v read [embeddings ; hidden]
    assert tensors["lm_head.weight"].shape == (32, d)
    assert tensors["d2t"].dtype == torch.int64 and torch.equal(tensors["d2t"] + torch.arange(32), draft.vocab_map)
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 32 and bool(tensors["t2d"][62])


def test_the_checkpoint_reads_back_as_the_same_draft(tiny_target, draft, tmp_path):
    out = eagle3_checkpoint.write_checkpoint(draft, tiny_target, tmp_path / "ckpt")
    again = eagle3_checkpoint.read_checkpoint(out, tiny_target)
    for prompt in PROMPTS:
        ours = run(tiny_target, AnchoredDrafter(draft, "eagle3"), 3, prompt)
        theirs = run(tiny_target, AnchoredDrafter(again, "eagle3"), 3, prompt)
        assert ours.token_ids == theirs.token_ids and ours.stats.acceptance_rate == theirs.stats.acceptance_rate
    built = build_drafter(f"model:{out}", tiny_target)  # a checkpoint directory is a draft spec too
    assert run(tiny_target, built.drafter, 3, PROMPTS[0]).token_ids == run(
        tiny_target, AnchoredDrafter(draft, "eagle3"), 3, PROMPTS[0]).token_ids


def test_a_checkpoint_with_speculators_names_reads_too(tiny_target, draft, tmp_path):
    out = eagle3_checkpoint.write_checkpoint(draft, tiny_target, tmp_path / "ckpt")
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(str(out / "model.safetensors")).items()}
    save_file(tensors, str(out / "model.safetensors"))
    again = eagle3_checkpoint.read_checkpoint(out, tiny_target)
    assert torch.equal(again.layer.q_proj.weight, draft.layer.q_proj.weight)


def test_foreign_checkpoints_are_refused_with_one_line(tiny_target, draft, tmp_path):
    out = eagle3_checkpoint.write_checkpoint(draft, tiny_target, tmp_path / "ckpt")
    with pytest.raises(DraftlabError, match="another shape"):
        eagle3_checkpoint.read_checkpoint(out, tiny_llama(hidden=48))
    with pytest.raises(DraftlabError, match="128-token vocabulary|vocabulary"):
        eagle3_checkpoint.read_checkpoint(out, tiny_llama(vocab=128))
    tensors = load_file(str(out / "model.safetensors"))
    del tensors["midlayer.hidden_norm.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(DraftlabError, match="lacks midlayer.hidden_norm.weight"):
        eagle3_checkpoint.read_checkpoint(out, tiny_target)
    (out / "model.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(DraftlabError, match="damaged"):
        eagle3_checkpoint.read_checkpoint(out, tiny_target)
    (out / "config.json").write_text("{not json")
    assert not eagle3_checkpoint.is_checkpoint(out)


def test_a_draft_directory_gets_its_engines_checkpoint_once_in_the_cache(tiny_target, draft, tmp_path, monkeypatch):
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))
    directory = save_eagle3_draft(draft, tmp_path / "draft", tiny_target.name)
    where = eagle3_checkpoint.engines_checkpoint(directory)
    assert where.parent == tmp_path / "cache" / "eagle3-checkpoints" and not where.exists()
    out = eagle3_checkpoint.ensure_engines_checkpoint(directory, tiny_target)
    assert out == where and eagle3_checkpoint.is_checkpoint(out)
    again = eagle3_checkpoint.read_checkpoint(out, tiny_target)
    assert run(tiny_target, AnchoredDrafter(again, "eagle3"), 3, PROMPTS[0]).token_ids == run(
        tiny_target, AnchoredDrafter(draft, "eagle3"), 3, PROMPTS[0]).token_ids
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert eagle3_checkpoint.ensure_engines_checkpoint(directory, tiny_target) == out  # once: not written again
    assert (out / "model.safetensors").stat().st_mtime_ns == written
    # another draft has another place; a directory holding its own checkpoint (`design eagle3`) gives that one
    draft.layer.fc.weight.data += 1
    other = save_eagle3_draft(draft, tmp_path / "other", tiny_target.name)
    assert eagle3_checkpoint.engines_checkpoint(other) != where
    own = eagle3_checkpoint.write_checkpoint(draft, tiny_target, other / eagle3_checkpoint.CHECKPOINT_DIR)
    assert eagle3_checkpoint.engines_checkpoint(other) == own == eagle3_checkpoint.engines_checkpoint(own)
    with pytest.raises(DraftlabError, match="neither an EAGLE-3 checkpoint nor an EAGLE-3 draft of draftlab's"):
        eagle3_checkpoint.engines_checkpoint(tmp_path / "nothing")
