"""The served engines' table: each speculative configuration against its own server's plain decoding at its level,
with a paired interval (or the words for too few prompts), and its outputs counted against draftlab's plain
decoding of the target."""

from __future__ import annotations

from draftlab.study.answer.serving import format_load, load_summaries, own_plain_gain, server_answer

TARGET = "smollm2-135m"


def row(method: str, prompt: int, wall_s: float, sha: str, drafter: str = "none", k: int = 0,
        concurrency: int = 1, identical: int | None = None) -> dict:
    return {"target": TARGET, "temperature": 0.0, "concurrency": concurrency, "method": method, "drafter": drafter,
            "k": k, "dataset": "heldout", "prompt_id": f"p{prompt}", "wall_s": wall_s, "new_tokens": 64,
            "window_tokens": 64 * concurrency, "latency_s": wall_s, "identical": identical, "drafted": 30,
            "accepted": 20, "output_sha": sha}


def study_rows(prompts: int) -> list[dict]:
    """draftlab's plain decoding, vLLM's plain decoding and its n-gram speculation (1.3x, +-5% per prompt);
    vLLM's outputs equal draftlab's on the even prompts only."""
    rows = []
    for p in range(prompts):
        rows.append(row("ar", p, 2.0, f"ref{p}"))
        ours = f"ref{p}" if p % 2 == 0 else f"other{p}"
        rows.append(row("vllm-ar", p, 4.0, ours))
        rows.append(row("vllm", p, 4.0 / (1.3 * (1.05 if p % 2 else 0.95)), ours, "ngram", 3, identical=1))
    return rows


def test_a_served_speculation_shows_its_gain_over_its_own_plain_decoding_with_a_paired_interval():
    summaries = load_summaries(study_rows(8))
    spec = next(s for s in summaries if s.method == "vllm" and s.dataset == "all")
    point, low, high, prompts = own_plain_gain(spec, summaries)
    assert prompts == 8 and low < point < high and 1.2 < point < 1.4 and high / low < 1.15
    plain = next(s for s in summaries if s.method == "vllm-ar" and s.dataset == "all")
    assert own_plain_gain(plain, summaries) is None
    assert spec.as_reference == 4 and plain.as_reference == 4  # the even prompts
    text = format_load(summaries)
    line = next(line for line in text.splitlines() if "ngram" in line)
    assert f"{point:.2f}x ({low:.2f}-{high:.2f})" in line and "4/8" in line


def test_too_few_prompts_give_no_interval_and_another_level_has_no_plain_to_pair_with():
    rows = study_rows(3) + [row("vllm", p, 1.0, "x", "ngram", 3, concurrency=2) for p in range(3)]
    summaries = load_summaries(rows)
    text = format_load(summaries)
    alone = next(line for line in text.splitlines() if "ngram" in line and "  1  " in line)
    assert "3 prompts: too few for an interval" in alone
    crowded = next(line for line in text.splitlines() if "ngram" in line and "  2  " in line)
    assert crowded.rstrip().endswith("-")  # vLLM's plain decoding did not run at concurrency 2


def test_one_request_at_a_time_without_llama_server_says_nothing_of_it():
    rows = study_rows(8) + [row(m, p, w / 1.5, f"ref{p}", d, k, concurrency=2, identical=1 if m == "vllm" else None)
                            for m, d, k, w in (("vllm-ar", "none", 0, 4.0), ("vllm", "ngram", 3, 3.0))
                            for p in range(8)]
    sentences = server_answer(load_summaries(rows))
    assert not any("llama-server" in s for s in sentences)
    assert any(s.startswith(f"Fastest for {TARGET} with 2 request(s) in flight: vLLM") for s in sentences)
