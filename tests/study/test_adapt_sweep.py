"""Online adaptation in a sweep: `--adapt` adds an adapting twin of each feature draft, each cell learns over its
own prompts in order, outputs stay plain decoding's, and a resumed cell goes on from a state that learned from
stored prompts only."""

from __future__ import annotations


import pytest

from draftlab.cli.main import main
from draftlab.models import load_model
from draftlab.study.run.runner import CellRunner
from draftlab.study.run.store import ResultsStore
from draftlab.study.run.sweep import make_config
from tests.conftest import feature_study


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapt-sweep")
    model, draft, prompts = feature_study(root, 4)
    return root, model, draft, prompts


@pytest.mark.slow
def test_adapting_cells_learn_their_prompts_and_resume_from_stored_ones(setup):
    root, model, draft, prompts = setup
    db = root / "study.sqlite"
    args = ["sweep", "--db", str(db), "--targets", str(model), "--drafters", f"model:{draft}", "--adapt",
            "every=8,lr=3e-3", "--ks", "2", "--methods", "sps", "--datasets", str(prompts), "--limit", "4",
            "--max-new-tokens", "32", "--warmup", "1", "--no-progress", "--dtype", "fp32", "--no-host-baselines",
            "--race-after", "0", "--budget", "0"]
    assert main(args) == 0
    store = ResultsStore(db)
    rows = store.rows()
    store.close()
    spec = f"adapt:every=8,lr=3e-3/model:{draft}"
    adapting = [r for r in rows if r["drafter"] == spec]
    assert len(adapting) == 4 and all(r["identical"] for r in adapting)
    assert len([r for r in rows if r["drafter"] == f"model:{draft}"]) == 4

    config = make_config("quick", targets=(str(model),), drafters=(spec,), ks=(2,), methods=("sps",),
                         datasets=(str(prompts),), limit=4, max_new_tokens=32, dtype="fp32", host_baselines=False,
                         budget_s=0)
    cell = next(c for c in config.cells(str(model), str(prompts), 0.0) if c.drafter == spec)
    cache_root = db.with_name(db.stem + ".suffix-caches")
    target = load_model(str(model), dtype="fp32")
    for stored, expected in ((4, 4), (3, 3), (2, 0)):  # the two newest states: after prompts 4 and 3
        done = {(cell.key, f"q{i}") for i in range(stored)}
        learner = CellRunner(target, config, cache_root=cache_root, done=done).cell_decoder(cell).drafter
        assert len(learner.requests) == expected
        assert (learner.learner.steps > 0) == (expected > 0)
    newest = next(cache_root.glob("*/state-0.pt"))  # after 4 prompts: 4 % 2
    newest.write_bytes(b"damaged")
    done = {(cell.key, f"q{i}") for i in range(4)}
    assert len(CellRunner(target, config, cache_root=cache_root, done=done).cell_decoder(cell).drafter.requests) == 3
