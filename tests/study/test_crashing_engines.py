"""A study on engines that crash: a preflight that dies by a signal or hangs leaves its engine out with one line, and
a cell that kills the study's process twice is skipped with that reason, the study finishing without it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from draftlab.contenders.preflight import FAULT_ENV, EngineCheck, check_engine
from draftlab.study.run.crashes import CRASH_ENV, LIMIT, SIGNAL_ENV
from draftlab.study.run.store import ResultsStore
from tests.conftest import tiny_model_dir


def prompts_file(path) -> str:
    path.write_text("".join(json.dumps({"prompt": " ".join(f"w{(i * 5 + j) % 60}" for j in range(12)), "category": "code", "id": f"q{i}"})
                            + "\n" for i in range(3)))
    return str(path)


def draftlab(args: list[str], env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftlab.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=timeout)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("crashing")
    return root, tiny_model_dir(root / "one", seed=0), tiny_model_dir(root / "two", seed=1)


def study_args(root, out) -> list[str]:
    """A study of the two tiny models, with the default preflight limit (which a healthy engine meets on any host)."""
    _, one, two = root
    return ["study", "--out", str(out), "--targets", str(one), str(two), "--drafters", "ngram", "--ks", "2",
            "--methods", "sps", "--datasets", prompts_file(root[0] / "p.jsonl"), "--limit", "3", "--max-new-tokens", "8",
            "--warmup", "0", "--no-host-baselines", "--race-after", "0", "--budget", "0", "--no-progress"]


# A hang is judged by its own limit (`hang=5`: the parent waits 5 s for that child); the healthy engine keeps the
# default limit (300 s), which it meets on any host: no test races the host's speed.
@pytest.mark.slow
@pytest.mark.parametrize("mode, words", [("segv", "was killed by SIGSEGV"),
                                         ("hang=5", "did not decode 4 tokens within 5 s (a hang)")])
def test_a_preflight_that_dies_leaves_its_engine_out_and_the_study_answers_with_the_others(models, mode, words):
    root, one, two = models
    out = root / f"study-{mode}"
    # The fault names the engine and, for the test, the source: one tiny model's torch engine dies, the other runs.
    result = draftlab(study_args(models, out), {FAULT_ENV: f"torch:{mode}:{two}"})
    assert result.returncode == 0, result.stderr[-2000:]
    lines = [line for line in result.stdout.splitlines() if words in line]
    assert len([line for line in lines if line.startswith("sweep: ")]) == 1, result.stdout
    assert str(two) in lines[0] and "left out:" in lines[0] and "\n" not in lines[0]
    assert any(line.startswith("Not run in this study, so not in the answer:") for line in lines)
    assert any(line.startswith("Use ") and str(one) in line for line in result.stdout.splitlines())
    store = ResultsStore(out / "study.sqlite", read_only=True)
    targets = {r["target"] for r in store.rows()}
    store.close()
    assert targets == {str(one)}  # the other engine ran every cell; the dead one none


@pytest.mark.slow
def test_a_study_whose_every_engine_fails_its_preflight_exits_1_with_a_line_per_engine(models):
    root, one, two = models
    result = draftlab(study_args(models, root / "study-all-dead"), {FAULT_ENV: "torch:segv"})
    assert result.returncode == 1, (result.stdout[-2000:], result.stderr[-2000:])
    lines = [line for line in result.stdout.splitlines() if "was killed by SIGSEGV" in line]
    assert len(lines) == 2 and any(str(one) in line for line in lines) and any(str(two) in line for line in lines)
    assert result.stderr.strip().splitlines() == [
        "draftlab: error: every engine of this study failed its preflight (said above, one line each); nothing was "
        "measured"]
    assert "Traceback" not in result.stdout + result.stderr and "draftlab sweep" not in result.stdout + result.stderr


@pytest.mark.slow
def test_a_preflight_reports_a_nonzero_exit_with_its_last_error_line(models):
    _, one, _ = models
    os.environ[FAULT_ENV] = f"torch:exit:{one}"
    try:
        verdict = check_engine(EngineCheck("torch", str(one), dtype="fp32"), timeout_s=300)
    finally:
        del os.environ[FAULT_ENV]
    assert not verdict.ok and "exited with code 1" in verdict.line and FAULT_ENV in verdict.line


@pytest.mark.slow
def test_a_cell_that_kills_the_process_twice_is_skipped_and_the_study_completes(models):
    root, one, _ = models
    db = root / "crash.sqlite"
    args = ["sweep", "--db", str(db), "--targets", str(one), "--drafters", "ngram", "layers:0-1", "--ks", "2",
            "--methods", "sps", "--datasets", prompts_file(root / "p.jsonl"), "--limit", "3",
            "--max-new-tokens", "8", "--warmup", "0", "--no-host-baselines", "--race-after", "0", "--budget", "0", "--no-progress",
            "--preflight-timeout", "0"]
    crash = {CRASH_ENV: "|sps|layers:0-1|"}
    first = draftlab(args, crash)
    assert first.returncode == -signal.SIGSEGV
    second = draftlab(args, crash)
    assert second.returncode == -signal.SIGSEGV
    assert "the last run died while running " in second.stdout
    assert "SPS layers:0-1 K=2 on q0 (Segmentation fault; 1 time(s); it runs again now)" in second.stdout
    third = draftlab(args, crash)  # it would crash again: the cell is skipped before it runs
    assert third.returncode == 0, third.stderr[-2000:]
    assert "(Segmentation fault; 2 time(s); its cell is skipped)" in third.stdout
    assert "killed the study's process 2 times (last while running q0)" in third.stdout
    store = ResultsStore(db, read_only=True)
    rows, skips = store.rows(), store.skips()
    store.close()
    assert {(r["drafter"], r["prompt_id"]) for r in rows} == {(d, f"q{i}") for d in ("none", "ngram") for i in range(3)}
    assert {s["prompt_id"] for s in skips if "layers:0-1" in s["cell"]} == {"q0", "q1", "q2"}
    assert all("killed the study's process 2 times" in s["reason"] for s in skips)


@pytest.mark.slow
def test_a_sweep_stopped_from_outside_is_not_taken_for_a_crash_and_completes(models):
    root, one, _ = models
    db = root / "stopped.sqlite"
    args = ["sweep", "--db", str(db), "--targets", str(one), "--drafters", "layers:0-1", "--ks", "2",
            "--methods", "sps", "--datasets", prompts_file(root / "p.jsonl"), "--limit", "2",
            "--max-new-tokens", "8", "--warmup", "0", "--no-host-baselines", "--race-after", "0", "--budget", "0", "--no-progress",
            "--preflight-timeout", "0"]
    for _ in range(LIMIT + 1):  # kill -9 at the same cell, more times than a crashing cell is allowed
        stopped = draftlab(args, {CRASH_ENV: "|sps|layers:0-1|", SIGNAL_ENV: "KILL"})
        assert stopped.returncode == -signal.SIGKILL
    assert "stopped from outside while running " in stopped.stdout and "(no crash: it runs again now)" in stopped.stdout
    assert "died" not in stopped.stdout
    done = draftlab(args, {})
    assert done.returncode == 0, done.stderr[-2000:]
    store = ResultsStore(db, read_only=True)
    rows, skips = store.rows(), store.skips()
    store.close()
    assert not skips and {(r["drafter"], r["prompt_id"]) for r in rows} == {
        (d, f"q{i}") for d in ("none", "layers:0-1") for i in range(2)}
    assert not (root / "stopped.sqlite.fatal").exists()  # removed by the sweep that ended well
