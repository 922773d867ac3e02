"""The one measurement loop: every timed decode in draftlab runs here.

A *contender* is anything that decodes token ids (`Contender`): draftlab's own decoder on any backend, HF's
`generate`, llama-cpp-python, a server. `measure` decodes a list of prompts with a set of contenders, interleaved
per prompt (the order rotated from prompt to prompt, so that a machine that speeds up or slows down hits every
contender alike), after untimed warm-up runs that teach drafters nothing; with a baseline it re-times the baseline
on the same prompt every few contenders, which measures the machine's drift. `run_once` is the loop's single timed
call; the sweep, which stores and resumes per (cell, prompt), calls `measure_prompt` for each prompt.

Prefill once per kernel set, file and prompt: contenders whose prefill of a prompt is one computation share a
`prefill_key` (draftlab's decoders of one backend, llama-cpp-python's plain decoding and lookup on one instance,
llama-servers of one build, file and context that differ only in their speculation); `measure_prompt` prefills the
prompt once per key, timed apart (`PrefillRecord`), every other contender of the key takes it untimed (a shared
cache, or a copy of the cache), and each contender's run then decodes from it: its timed run is its decode. A contender that cannot start from a prefill (HF `generate`) says so (`reuses_prefill` False): its
run prefills again, and the loop takes its key's prefill, timed apart, off its run.

Each run gives one `RunRecord`: output ids, the engine's statistics, the total time and, where the engine
reports it, the prefill's (draftlab's engine does; a peer library's `generate` does not). Speedups are defined
once, here, in two named kinds:

- `END_TO_END`: new tokens per second of the whole call, prefill included (what a user waits for);
- `DECODE`: new tokens per second after the prefill (what speculation changes; the tuner races on it).

Under load (`draftlab.measure.load`: a server answering N requests at once) the figure is the aggregate: all
requests' new tokens over the wall time from the first request sent to the last answer, beside each request's own
latency. The sweep measures load per (cell, prompt) with `InFlight`: the prompt sent together with N-1 companion
prompts, its record the prompt's own output, the window's wall time, the window's tokens and mean latency.

`speedup(runs, paces)`: the seconds the baseline needs for the runs' tokens (each prompt at the baseline's pace
on that prompt) over the runs' seconds. With equal outputs this is tokens/s over tokens/s; it stays defined when
outputs differ in length (sampling, a stop).
"""

from draftlab.measure.load import InFlight, LoadRun, measure_load  # noqa: F401
from draftlab.measure.loop import (  # noqa: F401  (the loop's names, as every caller imports them)
    DECODE, END_TO_END, KINDS, WARMUP_TOKENS, Contender, EncodedPrompt, Listener, Measurement, PrefillRecord,
    Rechecks, RunRecord, RunSettings, drift, measure, measure_prompt, paired, pilot, prefill_once, run_once, speedup,
    warm_up,
)
