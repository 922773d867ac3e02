"""A study that measured `draftlab serve` alone and at 4 requests in flight: its Deploy line, parsed from the study's
output and run as printed, is a server for load (the slow tier: a study, then a server)."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.integration.test_serve import TOKENS, plain, post, running_counts  # noqa: F401 (plain: a fixture)
from tests.serve_jobs import prompts, target  # noqa: F401 (the fixtures)

pytestmark = pytest.mark.integration


STUDY_UNDER_LOAD = """[sweep]
targets = ["llamacpp:smollm2-135m@Q4_0_PURE"]
drafters = ["suffix"]
ks = [3]
methods = ["serve"]
datasets = ["code-edit"]
limit = 4
max_new_tokens = 16
concurrency = [1, 4]
load_methods = ["serve", "serve-ar"]
load_ks = [0]
race_after = 0
budget_s = 0.0
host_baselines = false
preflight_s = 0.0
servers = []
"""


def deploy_command(tmp_path) -> str:
    """`draftlab study` on 4 code edits, draftlab serve alone and at 4 in flight: its Deploy line's `draftlab serve`
    command, as printed. Every configuration it races runs on draftlab serve (draftlab's llama.cpp plain decoding,
    draftlab serve's, suffix decoding at K 3 and `--k auto`; no llama-server: `servers = []` takes the quick preset's
    out), so whichever is fastest here, the answer's Deploy line is a `draftlab serve` command: the test does not
    depend on which wins."""
    import subprocess
    import sys

    (tmp_path / "load.toml").write_text(STUDY_UNDER_LOAD)
    done = subprocess.run([sys.executable, "-m", "draftlab.cli", "study", "--config", str(tmp_path / "load.toml"),
                           "--out", str(tmp_path / "study")], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("Deploy ") and ": draftlab serve " in line]
    assert len(lines) == 1, done.stdout[-3000:]
    return "draftlab serve " + lines[0].split(": draftlab serve ", 1)[1]


@pytest.mark.slow
def test_the_deploy_line_of_a_study_under_load_run_as_printed_serves_4_at_once_as_alone(tmp_path, prompts, plain):
    """A study that measured draftlab serve at 1 and 4 in flight prints a Deploy line for load (`--max-in-flight 4`);
    its command, run by a shell with the venv's `draftlab` first on PATH (on another port), serves 4 requests at once
    (/metrics shows 2 or more running together), each answer draftlab's plain decoding alone."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from draftlab.contenders.served import die_with_parent, free_port

    command = deploy_command(tmp_path)
    assert "--max-in-flight 4" in command, command  # sized for the most requests in flight the study measured
    port = free_port()
    words = shlex.split(command)
    words[words.index("--port") + 1] = str(port)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    with open(tmp_path / "serve.log", "wb") as log:
        process = subprocess.Popen(["bash", "-c", "exec " + shlex.join(words)], env=env, stdout=log,
                                   stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert process.poll() is None, (tmp_path / "serve.log").read_text()
                time.sleep(0.3)
        served = DeployedAt(port)
        chosen = [i for i, ids in enumerate(plain) if len(ids) == TOKENS][:4]
        with running_counts(served) as running, ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: post(served, "/v1/completions", json.dumps({
                "prompt": prompts[i], "max_tokens": TOKENS, "temperature": 0, "return_token_ids": True}).encode(),
                120, key="")[1]["choices"][0]["token_ids"], chosen))
        assert answers == [plain[i] for i in chosen]
        assert max(running) >= 2
    finally:
        process.terminate()
        process.wait(timeout=60)


@dataclass(frozen=True)
class DeployedAt:
    """A server started outside the tests' helpers, by its port (what `post` and `metrics_text` read)."""

    port: int
