"""The Hugging Face directory draftlab writes of a model (a GGUF de-quantized): one that transformers and vLLM load
alike, a tied model's shared matrix under the embeddings' name."""

from __future__ import annotations

import json

import pytest
import torch

from draftlab.models import save_checkpoint


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(63)} | {"[UNK]": 63}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


@pytest.mark.parametrize("tied", [True, False])
def test_the_checkpoint_loads_to_the_same_logits_and_a_tied_model_keeps_its_embeddings(tmp_path, tied):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).eval()
    save_checkpoint(model, _tokenizer(), tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    # vLLM loads a tied model's matrix from the embeddings only: it must be there (and once)
    assert "model.embed_tokens.weight" in names and ("lm_head.weight" in names) is not tied
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
