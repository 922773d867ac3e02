"""A sweep killed with SIGKILL resumes to exactly the records of an uninterrupted sweep.

Real processes, a real signal, a tiny model saved to disk with a word-level tokenizer.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from draftlab.study.run.store import ResultsStore
from tests.conftest import tiny_model_dir

DETERMINISTIC = ("cell", "prompt_id", "method", "drafter", "k", "new_tokens", "steps", "drafted", "accepted",
                 "accepted_per_step", "output_sha", "identical", "cache_held")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    model = tiny_model_dir(root / "tiny")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(
        json.dumps({"prompt": " ".join(f"w{(i * 7 + j) % 60}" for j in range(12)), "category": c, "id": f"q{i}"}) + "\n"
        for i, c in enumerate(["code", "chat", "code", "chat", "math", "math"])
    ))
    return root, model, prompts


def sweep_command(db, model, prompts):
    return [sys.executable, "-m", "draftlab.cli", "sweep", "--db", str(db), "--targets", str(model),
            "--drafters", "ngram", "layers:0-1", "suffix", "--ks", "1-2", "--datasets", str(prompts), "--limit", "6",
            "--max-new-tokens", "32", "--warmup", "0", "--no-progress", "--dtype", "fp32", "--no-host-baselines",
            "--race-after", "0", "--budget", "0",
            "--preflight-timeout", "0"]  # each engine's preflight is tests/study/test_crashing_engines.py's


def count(db) -> int:
    try:
        conn = sqlite3.connect(db, timeout=1)
        try:
            return conn.execute("SELECT COUNT(*) FROM records").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.Error:
        return 0


def deterministic_rows(db) -> list[tuple]:
    store = ResultsStore(db)
    rows = sorted(tuple(json.dumps(r[k]) for k in DETERMINISTIC) for r in store.rows())
    store.close()
    return rows


@pytest.mark.slow
def test_killed_sweep_resumes_to_the_same_records(setup):
    root, model, prompts = setup
    full_db, killed_db = root / "full.sqlite", root / "killed.sqlite"
    subprocess.run(sweep_command(full_db, model, prompts), check=True, capture_output=True, timeout=600)
    total = count(full_db)
    # prompts x (ar + HF's plain decoding + methods x drafters x K); HF has no suffix decoding
    assert total == 6 * (2 + 2 * 2 * 2 + 2)
    held = [r["cache_held"] for r in ResultsStore(full_db).rows() if r["drafter"] == "suffix" and r["k"] == 2]
    assert held == list(range(6))  # each cell learns from its own earlier prompts only

    process = subprocess.Popen(sweep_command(killed_db, model, prompts), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while count(killed_db) < total // 3 and process.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert process.poll() is None, "the sweep finished before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    interrupted = count(killed_db)
    assert 0 < interrupted < total

    resumed = subprocess.run(sweep_command(killed_db, model, prompts), check=True, capture_output=True,
                             text=True, timeout=600)
    assert f"{total - interrupted} new records" in resumed.stdout
    assert deterministic_rows(killed_db) == deterministic_rows(full_db)

    again = subprocess.run(sweep_command(killed_db, model, prompts), check=True, capture_output=True,
                           text=True, timeout=600)
    assert "nothing to do" in again.stdout and count(killed_db) == total

    bf16 = subprocess.run([*sweep_command(killed_db, model, prompts), "--dtype", "bf16", "--drafters", "ngram",
                           "--ks", "1", "--methods", "sps"], check=True, capture_output=True, text=True, timeout=600)
    assert "nothing to do" not in bf16.stdout and count(killed_db) == total + 6 * 2
    store = ResultsStore(killed_db)
    assert {r["dtype"] for r in store.rows()} == {"fp32", "bf16"}
    store.close()


def test_sweep_refuses_a_corrupted_database(setup):
    root, model, prompts = setup
    bad = root / "corrupt.sqlite"
    bad.write_bytes(b"\x00garbage" * 512)
    out = subprocess.run(sweep_command(bad, model, prompts), capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and "draftlab: error:" in out.stderr
    assert bad.read_bytes() == b"\x00garbage" * 512
