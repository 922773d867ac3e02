"""kill -9, again and again: a sweep with suffix and adapting cells, and a suffix cache appended by two processes.

A kill loses at most the record (or response) in flight: never a stored one; the next run resumes with nothing
duplicated and ends complete.
"""

from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from draftlab.drafters.suffix import read_responses
from tests.conftest import feature_study

pytestmark = pytest.mark.slow
KILLS = 10


def stored(db) -> set[tuple[str, str]]:
    try:
        conn = sqlite3.connect(db, timeout=5)
        try:
            pairs = conn.execute("SELECT cell, prompt_id FROM records").fetchall()
            assert len(pairs) == len(set(pairs))
            return set(pairs)
        finally:
            conn.close()
    except sqlite3.OperationalError:  # not created yet
        return set()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("kills")
    model, draft, prompts = feature_study(root, 8)
    return root, model, draft, prompts


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_sweep_killed_ten_times_loses_nothing_stored_and_completes(setup):
    root, model, draft, prompts = setup
    db = root / "killed.sqlite"
    command = [sys.executable, "-m", "draftlab.cli", "sweep", "--db", str(db), "--targets", str(model),
               "--drafters", "suffix", f"model:{draft}", "--adapt", "every=8", "--ks", "1-2", "--methods", "sps",
               "--datasets", str(prompts), "--limit", "8", "--max-new-tokens", "24", "--warmup", "0",
               "--no-progress", "--dtype", "fp32", "--no-host-baselines", "--race-after", "0", "--budget", "0"]
    chance = random.Random(7)
    before: set = set()
    for _ in range(KILLS):
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 120
        while len(stored(db)) <= len(before) and process.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(chance.uniform(0.0, 0.4))  # somewhere in the next record(s)
        if process.poll() is not None:
            assert process.returncode == 0, process.stderr.read().decode()[-2000:]
            break
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        now = stored(db)
        assert before <= now, "a kill lost a stored record"
        before = now
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    final = stored(db)
    assert before <= final
    assert len(final) == 8 * (1 + 2 * 3)  # ar + (suffix, feature, adapting feature) x 2 K, every prompt once


APPENDER = """
import sys, time
from draftlab.drafters.suffix import SuffixCache
cache = SuffixCache(responses=100000, store=sys.argv[1])
tag = int(sys.argv[2])
for i in range(400):
    request = cache.start([tag])
    cache.extend(request, [tag, i] + [i] * 30)
    cache.stop(request, [tag, i] + [i] * 30)
"""


@pytest.mark.slow
def test_a_suffix_cache_appended_by_two_processes_keeps_every_whole_response(tmp_path):
    store = tmp_path / "cache"
    chance = random.Random(11)
    for round_ in range(KILLS):
        writers = [subprocess.Popen([sys.executable, "-c", APPENDER, str(store), str(tag + 10 * round_)],
                                    stderr=subprocess.PIPE) for tag in (1, 2)]
        time.sleep(chance.uniform(2.0, 4.0))  # imports take ~2 s; then appends
        os.kill(writers[0].pid, signal.SIGKILL)
        for writer in writers:
            writer.wait(timeout=120)
        assert writers[1].returncode == 0, writers[1].stderr.read().decode()[-2000:]
    responses = read_responses(store / "responses.jsonl")
    for response in responses:  # whole: never two glued together, never a cut one kept
        assert len(response) == 32 and response[2:] == [response[1]] * 30
    survivors = {(r[0], r[1]) for r in responses}
    assert len(survivors) == len(responses)  # no response written twice
    for round_ in range(KILLS):
        complete = sorted(i for tag, i in survivors if tag == 2 + 10 * round_)
        assert complete == list(range(400))  # the writer that was not killed lost nothing
