"""A fake engine's contender module, for `test_fake_engine.py`: its plain decoding and its prompt lookup, which
run draftlab's own decoder behind a contender of their own and count their calls. Racing it takes this module and
one `backends.engines.Engine` entry naming it, nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from draftlab.contenders.contract import ContenderSource, Method
from draftlab.drafters.kinds import is_lookup
from draftlab.engine import GenerationResult


@dataclass(frozen=True)
class FakeRun:
    """A peer's contender: it times only the whole call (each run prefills), as a library's `generate` does."""

    decoder: object  # draftlab's decoder it runs behind
    times_prefill = False
    reuses_prefill = False
    prefill_key = ""

    def run(self, prompt_ids: list[int], settings) -> GenerationResult:
        CALLS.append(len(prompt_ids))
        return self.decoder.run(prompt_ids, settings)

    def forgetful(self) -> "FakeRun":
        return self


CALLS: list[int] = []  # every run of either method, in order (the test clears it)


def _plain(source: ContenderSource, cell, _companions: tuple) -> FakeRun:
    return FakeRun(source.decoder("none", 1))


def _lookup(source: ContenderSource, cell, _companions: tuple) -> FakeRun:
    return FakeRun(source.decoder(cell.drafter, cell.k))


FAKE_PLAIN = Method("fake-plain", "the fake engine", 2, "a fake engine", plain=True, reference="ar",
                    times_prefill=False, peer=True, torch_only=True, swept=False, build=_plain)
FAKE_LOOKUP = Method("fake-lookup", "the fake engine's lookup", 4, "a fake engine", plain=False,
                     reference="fake-plain", times_prefill=False, peer=True, torch_only=True, takes=is_lookup,
                     build=_lookup)
METHODS = (FAKE_PLAIN, FAKE_LOOKUP)
