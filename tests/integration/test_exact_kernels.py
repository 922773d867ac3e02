"""draftlab's exact llama.cpp kernels (scripts/llama-cpp/*.patch), bitwise on the host at hand: after a cached prefix
of 600 tokens, every row of a block of 2-16 rows (and of 20 and 24, past the one-gemv kernel) equals the same row
scored alone, with 1 and 2 threads, for every weight type the kernels claim (the types llamafile's sgemm serves at
every row count, repacked Q4_0 and Q4_K, and those vec_dot serves)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import draftlab.backends.llamacpp_sequences as llamacpp_module
from draftlab.backends.gguf import Q4_0_ROWS, Q4_K_ROWS, SGEMM_EVERY_ROW
from draftlab.backends.llamacpp import LlamaCppBackend
from draftlab.contenders.llama_server import build_dir
from draftlab.models import load_model
from tests.integration.test_no_amx import symbols
from tests.tiers import exhaustive, slow

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]

PREFIX = [100 + (i * 37) % 20000 for i in range(600)]
# Q4_1 (shipped): vec_dot; Q4_K_M: on SmolLM2's row length (576) mostly Q5_0, whose one row takes vec_dot and whose
# blocks take tinyBLAS (the patch's claim that both do the same per output), beside Q8_0, Q6_K's vec_dot and the
# repacked Q4_K of the MLP's down products (row length 1536: the one-gemv kernel); IQ4_NL: loaded without repack (its
# repacked gemm rounds apart), tinyBLAS at every row count beside Q5_K's vec_dot
TYPES = ["smollm2-135m", "smollm2-135m@Q4_0_PURE", "smollm2-135m@Q4_0", "smollm2-135m@Q8_0", "smollm2-135m@BF16",
         "smollm2-135m@Q4_K_M", "smollm2-135m@IQ4_NL"]


BLOCKS = (*range(2, 17), 20, 24)  # every decode block size, and two past the one-gemv kernel's 16 rows (gemm there)


def rows_alone_and_blocks(backend: LlamaCppBackend) -> list[str]:
    """'n=N row I' for every row of a block of N (BLOCKS) after PREFIX that differs from the same row alone."""
    backend.score(PREFIX, last_only=True)
    tokens, alone = [5], []
    for _ in range(max(BLOCKS)):
        alone.append(backend.score(tokens[-1:])[0])  # [V]
        tokens.append(int(alone[-1].argmax()))
    differing = []
    for n in BLOCKS:
        backend.rollback(len(PREFIX))
        block = backend.score(tokens[:n])  # [n, V]
        differing += [f"n={n} row {i}" for i in range(n) if not torch.equal(block[i], alone[i])]
    return differing


@pytest.mark.parametrize("source, threads", [("smollm2-135m@Q4_0_PURE", 2), *(slow(s, 2) for s in TYPES if s != "smollm2-135m@Q4_0_PURE"),
                                             *(exhaustive(s, 1) for s in TYPES)])  # Q4_0_PURE on 2 threads: the smoke test
def test_block_rows_are_bitwise_single_rows_for_every_weight_type(source, threads, monkeypatch, every_core):
    monkeypatch.setattr(llamacpp_module, "default_threads", lambda: threads)
    target = load_model(source, backend="llamacpp")
    assert {SGEMM_EVERY_ROW, Q4_0_ROWS, Q4_K_ROWS} <= set(target.model.exact_kernels) and target.model.sgemm
    backend = LlamaCppBackend(target.model)
    assert backend.batch_invariant and "sgemm at every row count" in backend.numerics
    assert rows_alone_and_blocks(backend) == []


def shape_gguf(name: str, out: Path, weight_type: str = "Q4_0_PURE") -> Path:
    """Random weights in a real model's shape (`checks.exactness.SHAPES`: its row lengths and widths, 2 layers) with
    SmolLM2's tokenizer (so a 49,152-token head), written as GGUF by the build's own converter, then derived in
    `weight_type` (pure Q4_0: every product on the repacked kernels; Q4_K_M: repacked Q4_K beside Q6_K's vec_dot):
    what the exact kernels see on that model."""
    from dataclasses import replace

    from transformers import AutoTokenizer

    from draftlab.backends.quantize import derive_weight_type
    from draftlab.checks.exactness import SHAPES, random_model
    from draftlab.design.eagle3_gguf import converter
    from draftlab.models import resolve_directory

    shape = replace(SHAPES[name], vocab=49152)
    hf_dir = out / name
    random_model(shape, torch.float16, layers=2).save_pretrained(hf_dir)
    AutoTokenizer.from_pretrained(resolve_directory("smollm2-135m")).save_pretrained(hf_dir)
    script, f16 = converter(), out / f"{name}.f16.gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent), str(script.parent / "gguf-py")])}
    # The converter names a BPE tokenizer's pre-tokenizer by a hash of known tokenizers' outputs; the tokenizer draftlab
    # writes back from SmolLM2's GGUF hashes otherwise, so it is named as the GPT-2 one (what llama.cpp splits with
    # does not matter here: the check scores token ids).
    run = ("import sys, convert_hf_to_gguf as convert; from conversion.base import TextModel; "
           "TextModel.get_vocab_base_pre = lambda self, tokenizer: 'gpt-2'; sys.argv = sys.argv[:1] + sys.argv[2:]; "
           "convert.main()")
    done = subprocess.run([sys.executable, "-c", run, "--", str(hf_dir), "--outtype", "f16", "--outfile", str(f16)],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return derive_weight_type(f16, weight_type, out)


SHAPE_CASES = [slow("qwen2.5-1.5b", "Q4_0_PURE"), exhaustive("qwen2.5-1.5b", "Q4_K_M"),
               exhaustive("qwen2.5-0.5b", "Q4_0_PURE"), exhaustive("qwen2.5-7b", "Q4_0_PURE"),
               exhaustive("qwen2.5-7b", "Q4_K_M"), exhaustive("llama-3-8b", "Q4_0_PURE"),
               exhaustive("llama-3-8b", "Q4_K_M")]


@pytest.mark.parametrize("shape, weight_type", SHAPE_CASES)
def test_block_rows_are_bitwise_single_rows_on_real_model_shapes(shape, weight_type, tmp_path, monkeypatch, every_core):
    """The repacked Q4_0 and Q4_K kernels' rows (row lengths 896-18944, widths up to 49,152) on 2 threads: every row
    of blocks of 2-16, 20 and 24 equals the same row alone, as on SmolLM2."""
    from draftlab.backends.gguf import tensor_types

    monkeypatch.setattr(llamacpp_module, "default_threads", lambda: 2)
    target = load_model(str(shape_gguf(shape, tmp_path, weight_type)), backend="llamacpp")
    assert {Q4_0_ROWS, Q4_K_ROWS} <= set(target.model.exact_kernels) and target.model.repack
    assert weight_type != "Q4_K_M" or "Q4_K" in tensor_types(target.model.path)  # the kernel under test serves it
    assert rows_alone_and_blocks(LlamaCppBackend(target.model)) == []


@pytest.mark.slow
def test_on_llamas_stock_kernels_the_same_check_finds_differing_rows():
    """The check can fail: the same comparison on llama.cpp's stock ggml-cpu (sgemm gated to 2+ rows, built beside
    draftlab's for the benchmarks, apart from it and without its patches) finds rows of Q4_0 blocks that differ from
    the same rows alone."""
    stock = extra_build("--stock")
    stock_symbols = symbols(stock / "libggml-cpu.so", dynamic=True)
    assert "llamafile_sgemm" in stock_symbols and "ggml_cpu_draftlab" not in stock_symbols
    assert (stock / "libggml-cpu.so").read_bytes() != (build_dir() / "lib" / "libggml-cpu.so").read_bytes()
    load_model("smollm2-135m@Q4_0", backend="llamacpp")  # derived (cached) in this process
    script = ("from draftlab.models import load_model\n"
              "from draftlab.backends.llamacpp import LlamaCppBackend\n"
              "from tests.integration.test_exact_kernels import rows_alone_and_blocks\n"
              "import warnings; warnings.simplefilter('ignore')\n"
              "target = load_model('smollm2-135m@Q4_0', backend='llamacpp')\n"
              "print(target.model.exact_kernels, len(rows_alone_and_blocks(LlamaCppBackend(target.model))))\n")
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(stock)}
    done = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    kernels, differing = done.stdout.split()[-2:]
    assert kernels == "()" and int(differing) > 0


def extra_build(which: str) -> Path:
    """A ggml-cpu built beside the exact build on demand (scripts/build-llama-cpp.sh --avx2: the exact kernels for AVX2
    only; --stock: llama.cpp's own; once, cached): its directory."""
    done = subprocess.run(["bash", str(ROOT / "scripts" / "build-llama-cpp.sh"), which, sys.executable],
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-2000:]
    return Path(done.stdout.strip().splitlines()[-1])


def holds_avx512(library: Path) -> bool:
    """Whether the library holds any instruction on 512-bit registers (objdump names them zmm)."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(library)], capture_output=True, text=True,
                             check=True).stdout
    return "%zmm" in listing


@pytest.mark.slow
def test_the_kernels_avx2_path_is_exact_on_an_avx2_only_build(every_core):
    """Whatever this host has, the kernels' AVX2 path (without AVX-512 or VNNI: the repacked Q4_0 and Q4_K rows'
    16-bit partial sums, 8 columns a pass) keeps every row of blocks of 2-16, 20 and 24 bitwise the row alone, with 1
    and 2 threads: on pure Q4_0 (every product on the Q4_0 kernel) and Q4_K_M (the Q4_K kernel beside vec_dot)."""
    lib_dir = extra_build("--avx2")
    assert not holds_avx512(lib_dir / "libggml-cpu.so")  # AVX2 only, whatever the native build holds
    sources = ("smollm2-135m@Q4_0_PURE", "smollm2-135m@Q4_K_M")
    for source in sources:
        load_model(source, backend="llamacpp")  # derived (cached) in this process
    script = ("import sys, warnings; warnings.simplefilter('ignore')\n"
              "import draftlab.backends.llamacpp_sequences as llamacpp_module\n"
              "from draftlab.models import load_model\n"
              "from draftlab.backends.llamacpp import LlamaCppBackend\n"
              "from tests.integration.test_exact_kernels import rows_alone_and_blocks\n"
              "llamacpp_module.default_threads = lambda: int(sys.argv[2])\n"
              "target = load_model(sys.argv[1], backend='llamacpp')\n"
              "print(len(target.model.exact_kernels), len(rows_alone_and_blocks(LlamaCppBackend(target.model))))\n")
    env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib_dir)}
    for source in sources:
        for threads in (1, 2):
            done = subprocess.run([sys.executable, "-c", script, source, str(threads)], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr[-2000:]
            kernels, differing = done.stdout.split()[-2:]
            assert int(kernels) >= 3 and differing == "0", (source, threads, differing)


STUDY_TARGET = "smollm2-135m@Q4_0_PURE"  # the quick study's llama.cpp target (study/config.py)


@pytest.mark.slow
def test_llama_servers_own_ngram_speculation_is_greedy_identical_to_its_plain_decoding(binary, tmp_path):
    """llama-server on draftlab's kernels (the same libraries): its own speculation keeps every output of its plain
    decoding on the quick study's prompts, where on llama.cpp's stock kernels it did not (docs/backends.md)."""
    from draftlab.api import prompt_ids
    from draftlab.contenders.llama_server import LlamaServer, ServerConfig
    from draftlab.files.datasets import load_prompts
    from draftlab.measure import EncodedPrompt, RunSettings, run_once
    from draftlab.models import gguf_path, gguf_tokenizer

    path, context = gguf_path(STUDY_TARGET), 2048
    tokenizer = gguf_tokenizer(STUDY_TARGET)
    prompts = [EncodedPrompt(p.id, p.category, prompt_ids(tokenizer, p)) for p in load_prompts("heldout", 8)]
    prompts = [p for p in prompts if len(p.ids) + 128 < context]
    configs = {"plain": ServerConfig(path, context=context),
               "ngram-mod": ServerConfig(path, spec_type="ngram-mod", context=context),
               "ngram-simple": ServerConfig(path, spec_type="ngram-simple", draft_n_max=16, context=context)}
    outputs, drafted = {}, 0
    for name, config in configs.items():
        with LlamaServer(config, tmp_path) as server:
            runs = [run_once(name, server.contender(context), p, RunSettings(128)) for p in prompts]
        outputs[name] = [r.token_ids for r in runs]
        drafted += sum(r.stats.drafted for r in runs)
    assert len(prompts) >= 6 and drafted > 0  # the speculation drafted: the comparison can fail
    assert outputs["ngram-mod"] == outputs["plain"] and outputs["ngram-simple"] == outputs["plain"]
    # ... and the server reproduces draftlab's own llama.cpp engine token for token (the Deploy line's promise)
    from draftlab.api import SpeculativeDecoder

    target = load_model(STUDY_TARGET, backend="llamacpp")
    engine = SpeculativeDecoder.from_names(target, drafter="ngram", k=3)
    assert [engine.generate(p.ids, max_new_tokens=128).token_ids for p in prompts] == outputs["plain"]


@pytest.mark.slow
def test_a_k_quant_file_loads_repacked_and_its_server_gets_the_switches():
    """With the one-gemv Q4_K kernel (scripts/llama-cpp/q4_K-rows.patch) a Q4_K_M file loads repacked and stays
    exact; llama-server keeps repack on for it (no `--no-repack`) and gets the tiled K-quant matmul off for its Q6_K,
    in the command a user deploys too. A library without that kernel would load it without repack."""
    from draftlab.backends.gguf import repack_keeps_rows
    from draftlab.contenders.llama_server import ServerConfig, server_kernels
    from draftlab.contenders.serve_check import parse_command
    from draftlab.models import gguf_path

    path = gguf_path("smollm2-135m@Q4_K_M")
    assert repack_keeps_rows(path) and not repack_keeps_rows(path, kernels=(SGEMM_EVERY_ROW, Q4_0_ROWS))
    assert Q4_K_ROWS in server_kernels()
    config = ServerConfig(path)
    assert "--no-repack" not in config.flags() and config.command().startswith("GGML_CPU_TILED_MM=0 llama-server ")
    parsed = parse_command(config.command())  # the printed command reads back as it runs
    assert parsed.model == config.model and parsed.env() == config.env() and "--no-repack" not in parsed.flags()
    target = load_model("smollm2-135m@Q4_K_M", backend="llamacpp")
    backend = LlamaCppBackend(target.model)
    assert target.model.repack and backend.batch_invariant and "Q4_0/Q4_K rows in one gemv" in backend.numerics
    assert rows_alone_and_blocks(backend) == []
