"""vLLM started, driven and stopped by draftlab: `vllm serve` from draftlab's vLLM environment on SmolLM2's converted
checkpoint (the shipped GGUF de-quantized), greedy, on the quick study's prompts.

The environment (3.4 GB) is made by `./run.sh --with vllm` or by the first study that races vLLM; without it these
tests skip, unless DRAFTLAB_REQUIRE_VLLM is set. CI does not make it and leaves this file out (.ci/run)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request

import pytest

from draftlab.api import prompt_ids
from draftlab.contenders import vllm_env
from draftlab.contenders.vllm import CONTEXT, SERVED_NAME, VllmConfig, VllmServer, deploy_command, speculative_config
from draftlab.files.datasets import load_prompts
from draftlab.measure import RunSettings
from draftlab.models import load_model, resolve_directory
from tests.integration.test_llama_server import alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TOKENS = 48


@pytest.fixture(scope="module")
def quick_prompts():
    if not vllm_env.ready():
        if os.environ.get("DRAFTLAB_REQUIRE_VLLM"):
            pytest.fail(f"no vLLM environment at {vllm_env.env_dir()}")
        pytest.skip("no vLLM environment: ./run.sh --with vllm makes it")
    target = load_model("smollm2-135m", dtype="fp32")
    return target, [prompt_ids(target.tokenizer, p) for p in load_prompts("heldout", 8)]


def _decode(config: VllmConfig, prompts: list[list[int]], log_dir) -> tuple[list[list[int]], int, int, list[int]]:
    """Each prompt's greedy tokens, the drafted and accepted totals, and the server's process ids (all stopped)."""
    settings = RunSettings(max_new_tokens=TOKENS, temperature=0.0)
    with VllmServer(config, log_dir) as server:
        run = server.contender(CONTEXT)
        results = [run.run(ids, settings) for ids in prompts]
        group = [int(p) for p in os.listdir("/proc") if p.isdigit() and _group_of(int(p)) == server.process.pid]
    return ([r.token_ids for r in results], sum(r.stats.drafted for r in results), sum(r.stats.accepted for r in results),
            group)


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_vllm_serves_the_checkpoint_and_its_ngram_speculation_keeps_its_plain_outputs(quick_prompts, tmp_path):
    target, prompts = quick_prompts
    model = resolve_directory("smollm2-135m")
    plain, drafted, _, group = _decode(VllmConfig(model, "fp32"), prompts, tmp_path)
    assert drafted == 0 and len(group) >= 2  # the API server and its engine core
    assert not any(alive(pid) for pid in group), "a vLLM process outlived its server"

    # the checkpoint loads in vLLM as in transformers: vLLM's greedy tokens start as draftlab's own (fp32 on both;
    # a tied model whose embeddings were missing decoded token 0 throughout)
    reference = [target.model.generate(_tensor(ids), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
                 for ids in prompts]
    assert sum(p[:8] == r for p, r in zip(plain, reference)) >= len(prompts) - 1

    spec = speculative_config("smollm2-135m", "ngram", 3)
    speculative, drafted, accepted, group = _decode(VllmConfig(model, "fp32", spec), prompts, tmp_path)
    assert drafted > 0 and 0 < accepted <= drafted
    assert not any(alive(pid) for pid in group)
    differing = [i for i, (a, b) in enumerate(zip(plain, speculative)) if a != b]
    assert not differing, f"vLLM's ngram speculation left its plain decoding on prompts {differing}"

    # the Deploy line of a vLLM answer, run as printed (by a shell, with the environment's `vllm` first on PATH),
    # serves the configuration the study measured: the same greedy tokens
    command = deploy_command("smollm2-135m", "fp32", "ngram", 3)
    assert command.startswith("VLLM_TARGET_DEVICE=cpu ") and f"--speculative-config '{spec}'" in command
    assert _serve_as_printed(command, prompts, tmp_path / "printed.log") == speculative


def test_vllm_runs_suffix_and_eagle3_with_draftlabs_shipped_draft(quick_prompts, tmp_path, monkeypatch):
    """vLLM's own suffix decoding and EAGLE-3 with the draft draftlab ships, handed over as the engines' checkpoint
    the study writes into the cache; a server of 4 slots serves one request as a server of one does. fp32."""
    target, prompts = quick_prompts
    model, prompts = resolve_directory("smollm2-135m"), prompts[:3]
    monkeypatch.setenv("DRAFTLAB_CACHE", str(tmp_path / "cache"))  # the checkpoint written here, not found
    plain, _, _, _ = _decode(VllmConfig(model, "fp32", slots=4), prompts, tmp_path)
    eagle3 = speculative_config("smollm2-135m", "eagle3", 3, target)
    assert str(tmp_path / "cache" / "eagle3-checkpoints") in eagle3
    for spec in (eagle3, speculative_config("smollm2-135m", "suffix", 3)):
        tokens, drafted, accepted, group = _decode(VllmConfig(model, "fp32", spec), prompts, tmp_path)
        assert drafted > 0 and 0 < accepted <= drafted, spec
        assert not any(alive(pid) for pid in group)
        assert tokens == plain, f"{spec} left vLLM's plain decoding (fp32)"


def _serve_as_printed(command: str, prompts: list[list[int]], log) -> list[list[int]]:
    """Each prompt's greedy tokens from the command run by bash as printed (its port, 8000, must be free); the
    server's whole process group stopped after."""
    port = int(command.rsplit("--port", 1)[1].split()[0])
    with socket.socket() as probe:
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            pytest.skip(f"port {port}, which the printed command names, is taken here")
    env = {**os.environ, "PATH": f"{vllm_env.vllm_command().parent}:{os.environ['PATH']}"}
    with open(log, "wb") as out:
        process = subprocess.Popen(["bash", "-c", command], stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    try:
        _wait_health(port, process)
        answers = [_post(port, {"model": SERVED_NAME, "prompt": ids, "max_tokens": TOKENS, "temperature": 0.0,
                                "return_token_ids": True}) for ids in prompts]
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # bash, vLLM's API server and its engine core
        except ProcessLookupError:
            pass
        process.wait()
    return [[int(t) for t in a["choices"][0]["token_ids"]] for a in answers]


def _wait_health(port: int, process: subprocess.Popen, timeout_s: float = 400.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the printed vLLM command exited at start"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"the printed vLLM command did not answer on port {port} within {timeout_s:.0f} s")


def _post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def _tensor(ids: list[int]):
    import torch

    return torch.tensor([ids])
