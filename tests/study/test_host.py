"""Cells against the plain decoding the host runs fastest, across engines: paired per prompt, drift cancelled through
the shared baseline, and ties between plain decodings settled for the engine that deploys (llama-server)."""

from __future__ import annotations

import pytest

from draftlab.contenders.vllm import deploy_command
from draftlab.study.answer.recommend import deploy_notes, recommend
from draftlab.study.answer.report import ALL, Drift, summarize
from tests.conftest import tiny_model_dir


def row(method: str, tokens_per_s: float, at: float, prompt: str, drafter: str = "none", k: int = 0) -> dict:
    return {"target": "t", "dataset": "d", "temperature": 0.0, "prompt_id": prompt, "method": method,
            "drafter": drafter, "k": k, "new_tokens": 100, "wall_s": 100 / tokens_per_s, "steps": 50, "drafted": 60,
            "accepted": 50, "prefill_s": 0.0, "draft_s": 0.0, "target_s": 0.0, "overhead_s": 0.0,
            "accepted_per_step": [], "drafted_per_step": [], "identical": 1, "finished_at": at, "backend": "llamacpp"}


def study(server: list[float], lcp: list[float], ngram: list[float]) -> list:
    """Per prompt (a 100 s window each): the baseline at 10 tok/s, then llama-server's and llama-cpp-python's
    plain decoding and an n-gram cell at the given tok/s."""
    rows = []
    for i, (a, b, c) in enumerate(zip(server, lcp, ngram)):
        prompt, at = f"p{i}", 100.0 * i
        rows += [row("ar", 10.0, at, prompt), row("server-ar", a, at + 10, prompt), row("llama", b, at + 20, prompt),
                 row("sps", c, at + 30, prompt, "ngram", 1)]
    return summarize(rows)


def judged(summaries, method: str):
    return next(s for s in summaries if s.method == method and s.dataset == ALL)


def test_a_plain_decoding_not_surely_faster_than_llama_servers_leaves_llama_server_the_reference():
    summaries = study([10.0, 11.2, 9.4, 11.0, 9.6, 10.8], [10.9, 10.1, 10.8, 10.2, 10.7, 10.3], [9.0] * 6)
    lcp, server, ngram = judged(summaries, "llama"), judged(summaries, "server-ar"), judged(summaries, "sps")
    assert lcp.tokens_per_s > server.tokens_per_s  # the faster on the whole, but within the noise of the pairs
    assert server.host_reference and not lcp.host_reference
    assert lcp.host_low < 1.0 < lcp.host_high
    assert ngram.host_speedup == pytest.approx(ngram.speedup / server.speedup)
    (use,) = recommend(summaries, Drift(6, 0.02))
    assert use.startswith("Use plain decoding on llama-server for t on this machine")


def test_a_plain_decoding_surely_faster_than_llama_servers_is_the_reference():
    summaries = study([10.0, 10.1, 9.9, 10.0, 10.05, 9.95], [11.0, 11.1, 10.9, 11.05, 11.0, 10.95], [9.0] * 6)
    lcp, server = judged(summaries, "llama"), judged(summaries, "server-ar")
    assert lcp.host_reference and not server.host_reference
    assert server.host_high < 1.0 and server.host_speedup == pytest.approx(server.speedup / lcp.speedup)
    (use,) = recommend(summaries, Drift(6, 0.02))
    assert use.startswith("Use plain decoding on llama.cpp (llama-cpp-python) for t on this machine")


def test_engines_of_one_target_are_compared_through_the_baseline_so_drift_cancels():
    # The host slows to half speed between llama-server's run of each prompt and llama-cpp-python's, and the
    # baseline re-timed after both sees it: the two decode alike.
    rows, checks = [], []
    for i in range(4):
        prompt, at = f"p{i}", 100.0 * i
        rows += [row("ar", 10.0, at, prompt), row("server-ar", 10.0, at + 1, prompt), row("llama", 5.0, at + 99, prompt)]
        checks.append(row("ar", 5.0, at + 99.5, prompt))
    summaries = summarize(rows, checks)
    lcp, server = judged(summaries, "llama"), judged(summaries, "server-ar")
    assert lcp.tokens_per_s == pytest.approx(0.5 * server.tokens_per_s)
    assert lcp.host_speedup == pytest.approx(1.0, rel=0.02) and server.host_reference  # raw rates: 0.5x


def _timed(target: str, method: str, prompt: str, prefill_s: float, decode_tokens_per_s: float, backend: str,
           drafter: str = "none", k: int = 0) -> dict:
    """A record of 128 new tokens: its engine's prefill of the prompt, then its decode at the given rate."""
    return {**row(method, 1.0, 0.0, prompt, drafter, k), "target": target, "new_tokens": 128, "prefill_s": prefill_s,
            "wall_s": prefill_s + 128 / decode_tokens_per_s, "backend": backend, "finished_at": None}


def amx_like_study() -> list:
    """Timings shaped like the AMX host's: draftlab's torch backend prefills in 0.48 s and decodes at 26 tok/s, within
    3x of llama.cpp's 65, whose engines (draftlab's, llama-cpp-python's, llama-server's) prefill in 5.1 s (no GEMM
    path for the file's type there); an n-gram cell on llama.cpp at 0.95x its plain decoding."""
    rows, llama = [], "llamacpp:m@Q4_1"
    for i in range(8):
        p, jitter = f"p{i}", 1 + 0.01 * (i % 3)
        rows += [_timed("m", "ar", p, 0.48, 26.0 * jitter, "fast"),
                 _timed(llama, "ar", p, 5.11, 65.0 * jitter, "llamacpp"),
                 _timed(llama, "llama", p, 5.11, 64.0 * jitter, "llamacpp"),
                 _timed(llama, "server-ar", p, 5.11, 65.4 * jitter, "llamacpp"),
                 _timed(llama, "sps", p, 5.11, 61.5 * jitter, "llamacpp", "ngram", 1)]
    return rows


def test_the_engine_is_the_one_that_answers_sooner_end_to_end_and_the_answer_says_which_decodes_faster():
    summaries = summarize(amx_like_study())
    (use,) = recommend(summaries, Drift(8, 0.03, 0.02))
    assert use.startswith("Use plain decoding on draftlab's torch backend for m on this machine: end to end, "
                          "128-token outputs, it answers a prompt in 5.36 s")
    assert "against 7.05 s for plain decoding on llama-server, which decodes faster (66.0 tok/s)" in use
    (note,) = deploy_notes(summaries, Drift(8, 0.03, 0.02))  # the Deploy line, llama-server's, says why it differs
    assert note.startswith("The answer for m runs on draftlab's torch backend")
    # Outputs ten times longer: decode outweighs the prefill, and the fastest decoder answers sooner too.
    (use,) = recommend(summaries, Drift(8, 0.03, 0.02), output_tokens=1280)
    assert use.startswith("Use plain decoding on llama-server for m on this machine: no configuration beat it")
    assert "end to end, 1280-token outputs" in use


def test_a_vllm_answer_deploys_the_command_the_study_served(tmp_path):
    model = str(tiny_model_dir(tmp_path / "tiny"))
    rows = []
    for i in range(8):
        p, jitter = f"p{i}", 1 + 0.01 * (i % 3)
        rows += [_timed(model, "ar", p, 0.5, 20.0 * jitter, "fast"),
                 _timed(model, "vllm-ar", p, 0.4, 40.0 * jitter, "fast")]
    summaries = summarize(rows)
    (use,) = recommend(summaries, Drift(8, 0.03, 0.02))
    assert use == f"Use plain decoding on vLLM for {model}."  # only plain decodings ran
    (note,) = deploy_notes(summaries, Drift(8, 0.03, 0.02), served_as=lambda s: ("bf16", 4))
    assert note.startswith(f"Deploy {model} on vLLM, the answer, as the study served it")
    # its server served every level of the study, up to 4 requests at once
    assert note.endswith(f"vllm serve {model} --dtype bfloat16 --max-model-len 4096 --max-num-seqs 4 "
                         "--served-model-name draftlab-target --host 127.0.0.1 --port 8000")
    # suffix decoding, whose cache keeps every answer, had a server of its own per level: one request at a time
    assert "--max-num-seqs 4 " in deploy_command(model, "bf16", "ngram", 3, most_in_flight=4)
    assert "--max-num-seqs 1 " in deploy_command(model, "bf16", "suffix", 3, most_in_flight=4)
