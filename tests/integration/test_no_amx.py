"""llama.cpp as installed and llama-server as built hold none of ggml's AMX kernels, which crash every decode on
AMX CPUs (docs/backends.md): checked in the binaries' symbols, not in the flags the build was given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.required import LLAMA_CPP, module_or_skip

ROOT = Path(__file__).resolve().parents[2]
AMX = "ggml_backend_amx"


def symbols(path: Path, dynamic: bool) -> str:
    return subprocess.run(["nm", *(["-D"] if dynamic else []), str(path)], capture_output=True, text=True,
                          check=True).stdout


def installed_ggml() -> list[Path]:
    from importlib.util import find_spec

    spec = find_spec("llama_cpp")
    if spec is None:
        module_or_skip("llama_cpp", LLAMA_CPP, "llama-cpp-python is not installed (./run.sh installs it)")
    return sorted((Path(spec.origin).parent / "lib").glob("libggml*.so"))


def test_the_installed_llama_cpp_holds_no_amx_kernels():
    libraries = installed_ggml()
    table = {lib.name: symbols(lib, dynamic=True) for lib in libraries}
    assert "ggml_backend_cpu_init" in "".join(table.values())  # the symbols are readable: the check can fail
    assert not [name for name, text in table.items() if AMX in text]
    check = subprocess.run(["bash", str(ROOT / "scripts/check-no-amx.sh"), sys.executable], capture_output=True)
    assert check.returncode == 0, check.stderr


def server_ggml(binary: Path) -> dict[str, str]:
    """The ggml libraries llama-server loads (beside it: scripts/build-llama-cpp.sh), by name: their symbols."""
    return {lib.name: symbols(lib, dynamic=True) for lib in sorted(binary.parent.glob("libggml*.so"))}


def test_the_built_llama_server_holds_no_amx_kernels(binary):
    table = server_ggml(binary)
    assert "ggml_backend_cpu_init" in "".join(table.values())  # the symbols are readable: the check can fail
    assert not [name for name, text in table.items() if AMX in text]


def test_llama_server_and_the_backend_share_draftlabs_exact_kernels(binary):
    """One build: llama-server and the library llama-cpp-python loads are the same files, whose ggml-cpu holds
    draftlab's kernel patches (llamafile's sgemm at every row count, its float jobs without barriers); llama.cpp's
    stock ggml-cpu, for the benchmarks, is built apart on demand (tests/integration/test_exact_kernels.py)."""
    installed = {lib.name: lib for lib in installed_ggml()}
    for name in ("libggml-cpu.so", "libggml-base.so"):
        assert (binary.parent / name).read_bytes() == installed[name].read_bytes()
    assert "ggml_cpu_draftlab_sgemm_every_row" in symbols(installed["libggml-cpu.so"], dynamic=True)
    assert "ggml_cpu_draftlab_q4_0_rows" in symbols(installed["libggml-cpu.so"], dynamic=True)
    assert "ggml_cpu_draftlab_sgemm_static_jobs" in symbols(installed["libggml-cpu.so"], dynamic=True)


def test_run_shs_check_finds_amx_kernels_in_a_cached_wheels_library(tmp_path):
    """What ./run.sh runs after pip: a llama_cpp whose ggml library exports AMX kernels (as a wheel built on an
    AMX host without the flags does, then reused from pip's cache) fails the check, so run.sh rebuilds it."""
    package = tmp_path / "llama_cpp"
    (package / "lib").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    source = tmp_path / "amx.c"
    source.write_text("void ggml_backend_amx_mul_mat(void) {}\nint ggml_backend_cpu_init(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(package / "lib/libggml-cpu.so"), str(source)], check=True)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    check = subprocess.run(["bash", str(ROOT / "scripts/check-no-amx.sh"), sys.executable], capture_output=True,
                           text=True, env=env)
    assert check.returncode == 1 and "holds ggml's AMX kernels" in check.stderr
    (source).write_text("int ggml_backend_cpu_init(void) { return 0; }\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(package / "lib/libggml-cpu.so"), str(source)], check=True)
    assert subprocess.run(["bash", str(ROOT / "scripts/check-no-amx.sh"), sys.executable], env=env).returncode == 0
