"""Designed drafts: pruning, the draft file format, cut vocabularies, distillation and its resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from draftlab.api import SpeculativeDecoder
from draftlab.design.distill import DistillSettings, distill, soft_cross_entropy, windows
from draftlab.design.layer_search import agreement, frequent_tokens, search_layers, target_next_tokens
from draftlab.drafters.designed import build_draft, draft_state, load_draft, save_draft
from draftlab.drafters import ModelDrafter, NoDrafter
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.backends import make_backend
from draftlab.decoding.policy import FixedK
from draftlab.decoding.sampling import SamplingConfig
from tests.conftest import tiny_model_dir

SEQUENCES = [[(i * 7 + j * 3) % 60 for j in range(40)] for i in range(6)]


def test_frequent_tokens_and_draft_round_trip(tiny_target, tmp_path):
    vocab_map = frequent_tokens(SEQUENCES, 20, always=(63,))
    assert len(vocab_map) == 20 and 63 in vocab_map.tolist() and vocab_map.tolist() == sorted(vocab_map.tolist())
    draft = build_draft(tiny_target, [0, 2], vocab_map)
    assert draft.model.model.lm_head.weight.shape[0] == 20
    assert draft.model.model.model.embed_tokens.weight.data_ptr() == tiny_target.model.model.embed_tokens.weight.data_ptr()
    before = tiny_target.model.model.layers[0].mlp.up_proj.weight.clone()
    draft.model.model.model.layers[0].mlp.up_proj.weight.data.add_(1.0)  # the draft owns copies of its layers
    assert torch.equal(tiny_target.model.model.layers[0].mlp.up_proj.weight, before)
    save_draft(draft, tmp_path / "d", "tiny")
    files = sorted(p.name for p in (tmp_path / "d").iterdir())
    assert files == ["draftlab_draft.json", "weights.safetensors"]
    loaded = load_draft(tmp_path / "d", tiny_target)
    assert loaded.layers == [0, 2] and torch.equal(loaded.vocab_map, vocab_map)
    saved, back = draft_state(draft), draft_state(loaded)
    assert saved.keys() == back.keys()
    for key in saved:
        assert torch.equal(saved[key], back[key]), key  # the weights saved are the weights loaded
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        torch.testing.assert_close(loaded.model.model(input_ids=tokens).logits, draft.model.model(input_ids=tokens).logits)


def test_cut_vocabulary_draft_is_lossless(tiny_target):
    vocab_map = frequent_tokens(SEQUENCES, 24)
    draft = build_draft(tiny_target, [0, 1, 2], vocab_map)
    prompt = SEQUENCES[0][:8]
    config = GenerationConfig(max_new_tokens=30)
    expected = SpeculativeEngine(make_backend(tiny_target.model), NoDrafter(), context_length=512).generate(prompt, config)
    for k in (1, 3, 5):
        drafter = ModelDrafter(make_backend(draft.model.model), "cut", vocab_map, tiny_target.vocab_size)
        engine = SpeculativeEngine(make_backend(tiny_target.model), drafter, FixedK(k), context_length=512)
        assert engine.generate(prompt, config).token_ids == expected.token_ids
    # sampling: the draft's probabilities are expressed over the full vocabulary
    drafter = ModelDrafter(make_backend(draft.model.model), "cut", vocab_map, tiny_target.vocab_size)
    drafter.begin(prompt)
    proposal = drafter.propose(prompt, 3, SamplingConfig(1.0), torch.Generator().manual_seed(0))
    assert proposal.draft_probs.shape == (3, tiny_target.vocab_size)
    assert set(proposal.tokens) <= set(vocab_map.tolist())
    outside = torch.ones(tiny_target.vocab_size, dtype=torch.bool)
    outside[vocab_map] = False
    assert proposal.draft_probs[:, outside].sum() == 0
    with pytest.raises(DraftlabError):
        ModelDrafter(make_backend(draft.model.model), "cut", vocab_map)


def test_layer_search_beats_or_matches_first_layers(tiny_target):
    sequences = [torch.tensor(s) for s in SEQUENCES]
    chosen, score = search_layers(tiny_target, sequences, 2, progress=False)
    first = agreement(target_next_tokens(tiny_target, sequences), build_draft(tiny_target, [0, 1]), sequences)
    assert len(chosen) == 2 and score >= first


@pytest.mark.slow
def test_distillation_raises_agreement(tiny_target, tmp_path):
    draft = build_draft(tiny_target, [0])
    sequences = [[(i * 5 + j * j) % 60 for j in range(64)] for i in range(40)]
    settings = DistillSettings(budget_s=6.0, seq_len=32, batch_size=8, lr=5e-3, checkpoint_every_s=2.0, top_k=8)
    distill(tiny_target, draft, sequences, tmp_path / "d", settings, "tiny", progress=False)
    history = draft.made["distill"]["history"]
    assert len(history) >= 2
    assert history[-1]["held_out_agreement"] > history[0]["held_out_agreement"] or history[-1]["held_out_agreement"] > 0.5
    assert load_draft(tmp_path / "d", tiny_target).made["distill"]["history"] == history


def test_soft_cross_entropy_is_minimal_at_the_teacher():
    teacher_values = torch.tensor([[[2.0, 1.0, 0.0]]])
    rows = torch.tensor([[[0, 1, 2]]])
    valid = torch.ones_like(rows, dtype=torch.bool)
    exact = soft_cross_entropy(teacher_values.clone(), teacher_values, rows, valid)
    worse = soft_cross_entropy(torch.tensor([[[0.0, 1.0, 2.0]]]), teacher_values, rows, valid)
    assert exact < worse
    # a position whose teacher top-k is wholly outside a cut vocabulary carries no signal, and no NaN
    none_valid = torch.zeros_like(valid)
    mixed = torch.cat([valid, none_valid], dim=1)
    loss = soft_cross_entropy(torch.cat([teacher_values, teacher_values], 1), torch.cat([teacher_values, teacher_values], 1),
                              torch.cat([rows, rows], 1), mixed)
    assert torch.isfinite(loss) and loss == pytest.approx(float(exact))
    with pytest.raises(DraftlabError):
        windows([[1, 2, 3]], 8)


def _distill_command(model, prompts, out):
    return [sys.executable, "-m", "draftlab.cli", "design", "distill", "--target", str(model), "--datasets",
            str(prompts), "--generate", "0", "--layers", "0", "--out", str(out), "--budget", "8",
            "--checkpoint-every", "1", "--seq-len", "16", "--batch-size", "4", "--top-k", "8", "--no-progress"]


@pytest.mark.slow
def test_killed_distillation_resumes_from_its_last_checkpoint(tmp_path):
    model = tiny_model_dir(tmp_path / "tiny")
    prompts = tmp_path / "text.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 3 + j) % 60}" for j in range(48))}) + "\n"
                               for i in range(30)))
    out = tmp_path / "draft"
    process = subprocess.Popen(_distill_command(model, prompts, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while process.poll() is None and time.time() < deadline:
        if (out / "checkpoint.pt").exists() and _logged_elapsed(out) > 3.0:
            break
        time.sleep(0.05)
    assert process.poll() is None, process.communicate()
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    killed_at = _logged_elapsed(out)
    checkpoint = torch.load(out / "checkpoint.pt", weights_only=False)
    lost = killed_at - checkpoint["elapsed"]
    assert 0 <= lost <= 1.0 + 0.5, f"lost {lost:.2f}s of training, more than one checkpoint interval"
    resumed = subprocess.run(_distill_command(model, prompts, out), capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from step {checkpoint['step']}" in resumed.stdout
    final = torch.load(out / "checkpoint.pt", weights_only=False)
    assert final["elapsed"] >= 8.0 and final["step"] > checkpoint["step"]
    steps = [json.loads(line)["step"] for line in (out / "distill_log.jsonl").read_text().splitlines()]
    restart = len(steps) - 1 - steps[::-1].index(checkpoint["step"] + 1)  # where the resumed run began
    assert steps[restart:] == list(range(checkpoint["step"] + 1, final["step"] + 1))
    assert steps[restart - 1] >= checkpoint["step"]  # the killed run got at least to its checkpoint


def _logged_elapsed(out) -> float:
    log = out / "distill_log.jsonl"
    if not log.exists():
        return 0.0
    lines = [line for line in log.read_text().splitlines() if line.endswith("}")]
    return json.loads(lines[-1])["elapsed_s"] if lines else 0.0


def test_designed_draft_through_the_api(tmp_path):
    model_dir = tiny_model_dir(tmp_path / "tiny")
    decoder = SpeculativeDecoder.from_names(str(model_dir), drafter="none", k=1)
    draft = build_draft(decoder.target, [0, 1], frequent_tokens(SEQUENCES, 30))
    save_draft(draft, tmp_path / "d", str(model_dir))
    spec = SpeculativeDecoder.from_names(decoder.target, drafter=f"model:{tmp_path / 'd'}", k=3)
    prompt = "w1 w2 w3 w4 w5"
    assert spec.generate(prompt, max_new_tokens=20).token_ids == decoder.generate(prompt, max_new_tokens=20).token_ids
    assert spec.draft_model.vocab_size == 30


@pytest.mark.parametrize("kind", ["fast", "hf"])
def test_backend_head_rows_give_those_logits_only(tiny_target, kind):
    rows = torch.tensor([0, 5, 9, 33, 63])
    full = make_backend(tiny_target.model, kind=kind)
    cut = make_backend(tiny_target.model, kind=kind, head_rows=rows)
    assert cut.vocab_size == 5 and full.vocab_size == 64
    tokens = [3, 1, 4, 1, 5]
    torch.testing.assert_close(cut.score(tokens), full.score(tokens)[:, rows])
    torch.testing.assert_close(cut.score([2, 6], last_only=True), full.score([2, 6], last_only=True)[:, rows])
    for bad in (torch.tensor([0, 64]), torch.tensor([-1]), torch.tensor([], dtype=torch.long)):
        with pytest.raises(DraftlabError, match="head rows"):
            make_backend(tiny_target.model, kind=kind, head_rows=bad)


def _cut_draft_dir(tmp_path, vocab_map, draft_seed=1):
    """A tiny target and a tiny stand-alone draft (same tokenizer), and a cut draft directory naming the draft."""
    from draftlab.drafters.cut import CutDraft, save_cut_draft
    from draftlab.models import load_model

    target_dir = tiny_model_dir(tmp_path / "target")
    draft_dir = tiny_model_dir(tmp_path / "draft", layers=2, seed=draft_seed)
    target = load_model(str(target_dir))
    save_cut_draft(CutDraft(str(draft_dir), vocab_map, {"method": "test"}), tmp_path / "cut", target)
    return target, tmp_path / "cut"


def test_cut_model_draft_is_lossless_and_drafts_only_its_tokens(tmp_path):
    vocab_map = frequent_tokens(SEQUENCES, 24)
    target, cut_dir = _cut_draft_dir(tmp_path, vocab_map)
    plain = SpeculativeDecoder.from_names(target, drafter="none", k=1)
    prompt = " ".join(f"w{t}" for t in SEQUENCES[1][:8])
    expected = plain.generate(prompt, max_new_tokens=24).token_ids
    for k in (1, 3):
        spec = SpeculativeDecoder.from_names(target, drafter=f"model:{cut_dir}", k=k)
        assert spec.generate(prompt, max_new_tokens=24).token_ids == expected
    drafter = spec.drafter
    assert drafter.backend.vocab_size == 24 and drafter.name.endswith("/v24")
    context = target.tokenizer(prompt)["input_ids"]
    drafter.begin(context)
    proposal = drafter.propose(context, 4, SamplingConfig(1.0), torch.Generator().manual_seed(0))
    assert set(proposal.tokens) <= set(vocab_map.tolist()) and proposal.draft_probs.shape == (4, 64)
    torch.testing.assert_close(proposal.draft_probs.sum(-1), torch.ones(4))
    # correlate reads the whole model through the cut vocabulary: tokens outside it are not counted
    from draftlab.design.correlate import draft_forward, perplexity

    model, kept, depth = draft_forward(target, f"model:{cut_dir}")
    ppl, coverage = perplexity(model, kept, 64, [SEQUENCES[2], SEQUENCES[3]])
    assert depth == 2 and torch.equal(kept, vocab_map) and ppl > 1.0 and 0.0 < coverage < 1.0


def test_cut_model_draft_refuses_damaged_or_foreign_records(tmp_path):
    from draftlab.registry import build_drafter
    from safetensors.torch import save_file

    target, cut_dir = _cut_draft_dir(tmp_path, torch.arange(10))
    save_file({"vocab_map": torch.tensor([1, 2, 99])}, str(cut_dir / "weights.safetensors"))
    with pytest.raises(DraftlabError, match="outside"):
        build_drafter(f"model:{cut_dir}", target)
    record = json.loads((cut_dir / "draftlab_draft.json").read_text())
    (cut_dir / "draftlab_draft.json").write_text(json.dumps({**record, "target_vocab_size": 32}))
    with pytest.raises(DraftlabError, match="32 tokens"):
        build_drafter(f"model:{cut_dir}", target)
    (cut_dir / "weights.safetensors").write_bytes(b"not a safetensors file")
    (cut_dir / "draftlab_draft.json").write_text(json.dumps(record))
    with pytest.raises(DraftlabError, match="damaged"):
        build_drafter(f"model:{cut_dir}", target)


@pytest.mark.slow
def test_design_cut_command_writes_a_draft_of_the_most_frequent_tokens(tmp_path):
    target_dir = tiny_model_dir(tmp_path / "target")
    draft_dir = tiny_model_dir(tmp_path / "draft", layers=2, seed=1)
    prompts = tmp_path / "text.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i + j * j) % 40}" for j in range(30))}) + "\n"
                               for i in range(8)))
    command = [sys.executable, "-m", "draftlab.cli", "design", "cut", "--target", str(target_dir), "--draft",
               str(draft_dir), "--datasets", str(prompts), "--generate", "0", "--vocab", "16", "--out",
               str(tmp_path / "cut"), "--no-progress"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "keeps 16 of 64 output tokens (16 most frequent in the text)" in done.stdout
    record = json.loads((tmp_path / "cut" / "draftlab_draft.json").read_text())
    assert record["format"] == "draftlab-cut-draft" and record["vocab_size"] == 16
    assert 0.3 < record["made"]["text_coverage"] < 1.0
    foreign = tiny_model_dir(tmp_path / "foreign", vocab=32)
    command[command.index("--draft") + 1] = str(foreign)
    refused = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert refused.returncode != 0 and "vocabulary" in refused.stderr


def test_fill_by_rank_tops_up_with_the_lowest_free_ids():
    from draftlab.design.layer_search import fill_by_rank

    assert fill_by_rank(torch.tensor([3, 9]), 5, 64).tolist() == [0, 1, 2, 3, 9]
    assert fill_by_rank(torch.tensor([3, 9]), 2, 64).tolist() == [3, 9]
    assert fill_by_rank(torch.tensor([1]), 10, 4).tolist() == [0, 1, 2, 3]
