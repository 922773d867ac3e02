"""Under load a prompt is timed beside companions its server never times: no timed request was served before on
its server (a drafter that learns across requests would already know its answer)."""

from __future__ import annotations

import json

from draftlab.study.run.config import SweepConfig
from draftlab.study.run.sweep import companions, plan


def served_before_timed(group, load: int) -> list[str]:
    """Timed prompts a server saw before their own timed run: every request it got, in the sweep's order."""
    seen: set[str] = set()
    early = []
    for index, prompt in enumerate(group.prompts):
        if prompt.id in seen:
            early.append(prompt.id)
        seen |= {prompt.id} | {c.id for c in companions(group.companions, index, load)}
    return early


def test_companions_come_from_prompts_the_server_never_times():
    config = SweepConfig(targets=("llamacpp:smollm2-135m",), drafters=("suffix",), ks=(4,), methods=("serve",),
                         datasets=("humaneval",), limit=8, concurrency=(1, 4), host_baselines=False)
    group, = plan(config)
    assert len(group.prompts) == 8 and len(group.companions) == 3
    assert not {p.id for p in group.companions} & {p.id for p in group.prompts}
    assert served_before_timed(group, 3) == []
    # The old rule (the next prompts of the group, wrapping around) served every prompt before timing it.
    old = type(group)(group.dataset, group.temperature, group.prompts, group.cells,
                      group.prompts[1:] + group.prompts[:1])
    assert len(served_before_timed(old, 3)) == 7


def test_a_dataset_with_no_prompts_left_holds_its_last_timed_ones_back(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"prompt number {i}"}) + "\n" for i in range(5)))
    config = SweepConfig(targets=("llamacpp:smollm2-135m",), drafters=("suffix",), ks=(4,), methods=("serve",),
                         datasets=(str(path),), limit=5, concurrency=(1, 4), host_baselines=False)
    group, = plan(config)
    assert len(group.prompts) == 2 and len(group.companions) == 3
    assert served_before_timed(group, 3) == []
    alone = SweepConfig(targets=("llamacpp:smollm2-135m",), drafters=("suffix",), ks=(4,), methods=("serve",),
                        datasets=(str(path),), limit=5, host_baselines=False)
    assert [len(g.prompts) for g in plan(alone)] == [5] and plan(alone)[0].companions == []
