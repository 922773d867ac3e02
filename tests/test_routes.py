"""Routes: every exact route makes block rows bitwise the rows scored alone; the choice follows measured timings."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from draftlab.backends import FastLlamaBackend
from draftlab.backends import routes
from draftlab.backends.routes import ProductTimings, Route, Shapes, choose, exact_routes, parse_route
from draftlab.drafters import NGramDrafter, NoDrafter
from draftlab.engine import GenerationConfig, SpeculativeEngine
from draftlab.errors import DraftlabError
from draftlab.decoding.policy import FixedK
from draftlab.decoding.step import Block
from tests.conftest import tiny_llama

PREFIX = [3, 14, 15, 92, 65, 35, 89]
TOKENS = [(7 * i + 5) % 256 for i in range(16)]


@pytest.fixture(scope="module")
def wide():
    """A tiny Llama wide enough that its products use the blocked GEMM kernels of real models."""
    return tiny_llama(vocab=256, layers=2, seed=11, hidden=128).model


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_every_exact_route_scores_blocks_of_1_to_16_bitwise_as_rows_alone(wide, dtype):
    model = copy.deepcopy(wide).to(routes.TORCH_DTYPES[dtype])
    for route in exact_routes(dtype):
        alone = FastLlamaBackend(model, route=route)
        alone.score(PREFIX)
        expected = torch.cat([alone.score([t]) for t in TOKENS])  # [16, V]
        backend = FastLlamaBackend(model, route=route)
        backend.score(PREFIX)
        for n in range(1, 17):
            backend.rollback(len(PREFIX))
            block = backend.score_block(Block.chain(TOKENS[:n])).logits  # [n, V]
            assert torch.equal(block, expected[:n]), f"{route.label}: block of {n}"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_measured_default_is_exact_and_greedy_speculation_equals_plain(wide, dtype):
    model = copy.deepcopy(wide).to(routes.TORCH_DTYPES[dtype])
    backend = FastLlamaBackend(model)
    assert backend.batch_invariant and backend.route.exact and backend.route.dtype == dtype
    prompt = [5, 6, 7, 5, 6, 7, 5, 6] * 3  # long enough that the prefill runs the fast products
    config = GenerationConfig(max_new_tokens=32)
    plain = SpeculativeEngine(FastLlamaBackend(model), NoDrafter(), FixedK(1), context_length=512).generate(prompt, config)
    for k in (1, 2, 3, 5, 8):
        engine = SpeculativeEngine(FastLlamaBackend(model), NGramDrafter(max_n=2, min_n=1), FixedK(k), context_length=512)
        assert engine.generate(prompt, config).token_ids == plain.token_ids, f"K={k}"


def test_a_prefill_runs_fast_products_and_leaves_the_same_cache_for_every_caller(wide):
    exact = FastLlamaBackend(wide, route=Route("fp32", "linear", 1))
    exact.score(PREFIX * 3, last_only=True)
    keys = [k[:, : len(PREFIX) * 3].clone() for k in exact._keys]
    again = FastLlamaBackend(wide, route=Route("fp32", "weight-major", 4))
    again.score(PREFIX * 3, last_only=True)  # another exact route prefills with the same fast products
    assert all(torch.equal(a, b[:, : len(PREFIX) * 3]) for a, b in zip(keys, again._keys))
    rows = FastLlamaBackend(wide, route=Route("fp32", "linear", 1))
    rows.score(PREFIX * 3)  # not a prefill: every row through the exact route
    assert all(torch.allclose(a, b[:, : len(PREFIX) * 3], atol=1e-4) for a, b in zip(keys, rows._keys))


def timings(dtype: str, one: dict[int, float], wm: dict[int, float]) -> ProductTimings:
    return ProductTimings(dtype, {"linear": one, "weight-major": wm})


def test_choice_keeps_plain_decoding_within_ten_percent_then_takes_the_cheapest_blocks():
    # fp32: F.linear one row 10 ms, blocks dear; weight-major 4 rows 10.5 ms (within 10%), blocks cheap.
    fp32 = timings("fp32", {1: 10, 2: 19, 4: 30, 8: 40, 16: 60}, {1: 12, 2: 10.4, 4: 10.5, 8: 16, 16: 30})
    # bf16: one row 9 ms (fastest) but its 16-row product costs 14 ms
    bf16 = timings("bf16", {1: 9, 2: 12, 4: 13, 8: 13.5, 16: 14}, {1: 30, 2: 30, 4: 30, 8: 30, 16: 30})
    choice = choose([fp32, bf16])
    assert choice.route.exact
    one = {label: o for label, o, _ in choice.candidates}
    assert one[choice.route.label] <= 1.10 * 9
    assert choice.route == Route("bf16", "linear", 1) or one[choice.route.label] <= 9.9
    assert choose([fp32, bf16], dtype="fp32").route == Route("fp32", "weight-major", 4)


def test_auto_runs_fp32_where_fp32_plain_decoding_beats_every_bf16_route():
    fp32 = timings("fp32", {1: 10, 2: 11, 4: 12, 8: 20, 16: 40}, {1: 11, 2: 11, 4: 12, 8: 20, 16: 40})
    bf16 = timings("bf16", {1: 20, 2: 21, 4: 22, 8: 23, 16: 24}, {1: 40, 2: 40, 4: 40, 8: 40, 16: 40})
    assert choose([fp32, bf16]).route.dtype == "fp32"


def test_timings_are_measured_once_then_read_from_the_cache(tmp_path):
    shapes = Shapes(((24, 16), (16, 16), (48, 16), (16, 24)), 2, (32, 16))
    first = routes.measured_timings(shapes, ("fp32",), tmp_path)
    files = list(tmp_path.glob("fp32-*.json"))
    assert len(files) == 1 and set(first[0].seconds["linear"]) == set(routes.ROWS)
    files[0].write_text(json.dumps({"dtype": "fp32", "seconds": {"linear": {"1": 1.0}, "weight-major": {"1": 2.0}}}))
    assert routes.measured_timings(shapes, ("fp32",), tmp_path)[0].seconds["linear"] == {1: 1.0}  # read, not re-timed
    files[0].write_text("not json")
    assert set(routes.measured_timings(shapes, ("fp32",), tmp_path)[0].seconds["linear"]) == set(routes.ROWS)


def test_routes_parse_from_their_labels_and_refuse_nonsense():
    for route in [*exact_routes("bf16"), Route("fp32", "linear", 0), Route("fp32", "weight-major", 0)]:
        assert parse_route(route.label) == route
    assert parse_route("exact-wm/4", dtype="fp32") == Route("fp32", "weight-major", 4)
    assert not parse_route("fp32 linear").exact
    for bad in ("fp32 exact-linear/3", "int8 linear", "fp32 exact-linear", "fp32 linear/4", "fast"):
        with pytest.raises(DraftlabError):
            parse_route(bad)
    with pytest.raises(DraftlabError, match="load the model in bf16"):
        FastLlamaBackend(tiny_llama().model, route=Route("bf16", "linear", 1))


def test_timings_are_kept_apart_per_isa_setting(monkeypatch):
    """Capping torch's or oneDNN's instruction set changes what is fastest: such timings are never reused."""
    shapes = Shapes(((24, 16), (16, 16), (48, 16), (16, 24)), 2, (32, 16))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    native = routes._cache_key(shapes, "bf16")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert routes._cache_key(shapes, "bf16") != native
    assert routes._cache_key(shapes, "bf16") != routes._cache_key(shapes, "fp32")


def test_the_cpus_dtype_candidates_follow_its_flags_unless_fixed_for_another_host(monkeypatch):
    monkeypatch.delenv(routes.CPU_DTYPES_ENV, raising=False)
    native_fp16 = bool(routes.cpu_flags() & {"avx512_fp16", "amx_fp16"})
    assert routes.candidate_dtypes() == (("fp32", "bf16", "fp16") if native_fp16 else ("fp32", "bf16"))
    for forced in ("fp32", "fp32,bf16", "fp32,bf16,fp16"):  # an AVX2 host's, an AVX-512 BF16 host's, an AMX host's
        monkeypatch.setenv(routes.CPU_DTYPES_ENV, forced)
        assert routes.candidate_dtypes() == tuple(forced.split(","))
    assert routes.candidate_dtypes("cuda") == ("bf16", "fp16", "fp32")
    for bad in ("bf16", "fp32,int8"):
        monkeypatch.setenv(routes.CPU_DTYPES_ENV, bad)
        with pytest.raises(DraftlabError, match=routes.CPU_DTYPES_ENV):
            routes.candidate_dtypes()
