"""The depth/width microbenchmark builds the three series and times them."""

from __future__ import annotations

from draftlab.design import microbench
from tests.conftest import tiny_llama


def test_series_shapes_follow_the_target():
    config = tiny_llama(layers=6, hidden=64).model.config
    shapes = microbench.shapes_for(config)
    by_series = {s: [x for x in shapes if x.series == s] for s in ("fixed_params", "fixed_width", "fixed_depth")}
    assert all(by_series.values())
    assert all(s.hidden == 64 for s in by_series["fixed_width"])
    assert all(s.layers == 4 for s in by_series["fixed_depth"])
    fixed = by_series["fixed_params"]
    assert fixed[0].layers > fixed[-1].layers and fixed[0].hidden < fixed[-1].hidden
    for s in shapes:
        assert s.hidden % s.heads == 0 and s.heads % s.kv_heads == 0


def test_run_and_plot(tmp_path):
    config = tiny_llama(layers=4, hidden=32).model.config
    timings = microbench.run(config, context=8, steps=2, progress=False)
    assert len(timings) == len(microbench.shapes_for(config))
    assert all(t.ms_per_token > 0 for t in timings)
    assert config.num_hidden_layers == 4  # the target's config is not modified
    paths = microbench.plot(timings, tmp_path)
    assert [p.name for p in paths] == ["microbench_fixed_params.png", "microbench_fixed_width.png",
                                       "microbench_fixed_depth.png"]
    assert "ms/token" in microbench.format_table(timings)
