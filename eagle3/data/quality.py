"""Data quality: the signs of a target that is not really answering, measured on the replies it generated.

A draft trained on degenerate replies learns them perfectly (a target that writes one token forever gives a
simulated accept length at the physical limit), so nothing downstream would notice. Measured per set of replies:
- the share of generated tokens taken by the most frequent id (a target repeating one token);
- the distinct 4-gram ratio within a reply, averaged over replies (a target looping over a phrase);
- replies with no text, only whitespace or special tokens (a stop token the target writes first);
- replies that hit max_new_tokens without an end token (a stop token the engine does not know);
- replies identical to another reply (a target that ignores the prompt).
Each measure has a threshold in `data.quality`; a crossed one is a problem with a code, the evidence and the
usual cause. Codes listed in `data.quality.waive` are accepted on purpose and recorded as waived.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3.config.sections import QualitySection
from eagle3.data.prompts import file_lines, parse_turns
from eagle3.errors import Eagle3Error, UnreadableInput

NGRAM = 4
CHECK_TEMPLATE = "check the chat template and the stop tokens"


class DataQualityError(Eagle3Error):
    """Regenerated data that crosses a data.quality threshold: a draft trained on it would learn the defect."""


@dataclass(frozen=True)
class Reply:
    ids: tuple[int, ...]  # the generated ids, as the engine returned them
    text: str  # decoded without special tokens
    hit_limit: bool | None  # stopped at max_new_tokens with no end token; None when unknown (a file of replies)


class Meter:
    """The quality figures of a stream of replies, kept in counters (a Kimi-sized set has ~10^8 generated tokens:
    replies are not held, only a digest of each for the duplicate count)."""

    def __init__(self):
        self.counts: Counter[int] = Counter()  # generated tokens by id
        self.replies = self.empty = self.hit_limit = self.limit_known = self.measured_ngrams = 0
        self.ngram_ratios = 0.0  # summed over the replies long enough to have an n-gram
        self.copies: Counter[bytes] = Counter()  # reply digest -> how many replies have exactly those ids
        self.openings: dict[bytes, tuple[int, ...]] = {}  # reply digest -> its first ids, to show a repeated one

    def add(self, reply: Reply) -> None:
        self.replies += 1
        self.counts.update(reply.ids)
        if len(reply.ids) >= NGRAM:
            self.measured_ngrams += 1
            self.ngram_ratios += distinct_ngram_ratio(reply.ids)
        self.empty += not reply.text.strip()
        if reply.hit_limit is not None:
            self.limit_known += 1
            self.hit_limit += reply.hit_limit
        digest = hashlib.blake2b(array("q", reply.ids).tobytes(), digest_size=16).digest()
        self.copies[digest] += 1
        self.openings.setdefault(digest, reply.ids[:16])

    def figures(self) -> dict:
        """Shares in [0, 1]; None where nothing was measured."""
        tokens = sum(self.counts.values())
        top_id, top_count = self.counts.most_common(1)[0] if self.counts else (None, 0)
        repeated, copies = self.copies.most_common(1)[0] if self.copies else (b"", 0)
        n = max(self.replies, 1)
        return {
            "replies": self.replies,
            "tokens": tokens,
            "top_token_id": top_id,
            "top_token_share": top_count / max(tokens, 1),
            "distinct_ngram_ratio": self.ngram_ratios / self.measured_ngrams if self.measured_ngrams else None,
            "empty_share": self.empty / n,
            "hit_limit_share": self.hit_limit / self.limit_known if self.limit_known else None,
            "duplicate_share": (self.replies - len(self.copies)) / n,
            "most_repeated_copies": copies,
            "most_repeated_ids": list(self.openings.get(repeated, ())),
        }


def replies_in_file(path: Path, encode) -> Iterator[Reply]:
    """The assistant turns of a file of conversations (ShareGPT or OpenAI messages JSONL) as replies, tokenized
    with `encode(text)`; whether a reply hit a token limit is not known from text."""
    for number, line in enumerate(file_lines(Path(path)), start=1):  # a missing or non-UTF-8 file is named
        if not line.strip():
            continue
        try:
            turns = parse_turns(line)
        except ValueError as err:
            raise UnreadableInput(f"{path}:{number}: {err}") from None
        for turn in turns:
            if turn["role"] == "assistant":
                yield Reply(tuple(encode(turn["content"])), turn["content"], None)


def distinct_ngram_ratio(ids: tuple[int, ...]) -> float:
    grams = list(zip(*(ids[k:] for k in range(NGRAM))))  # zip stops at the last whole n-gram
    return len(set(grams)) / len(grams)


def problems(figures: dict, limits: QualitySection, max_new_tokens: int | None, describe) -> list[dict]:
    """The thresholds `figures` crosses, as {code, message, waived}; `describe(ids)` shows ids as text."""
    found = []

    def crossed(code: str, message: str) -> None:
        found.append({"code": code, "message": message, "waived": code in limits.waive})

    share = figures["top_token_share"]
    if figures["tokens"] and share > limits.max_top_token_share:
        token = figures["top_token_id"]
        crossed("repeated-token", f"{share:.0%} of generated tokens are id {token} {describe([token])!r} (threshold "
                f"{limits.max_top_token_share:.0%}): the target repeats itself; {CHECK_TEMPLATE}")
    ratio = figures["distinct_ngram_ratio"]
    if ratio is not None and ratio < limits.min_distinct_ngram_ratio:
        crossed("looping", f"a reply's {NGRAM}-grams are only {ratio:.0%} distinct on average (threshold "
                f"{limits.min_distinct_ngram_ratio:.0%}): the target loops over the same phrase; {CHECK_TEMPLATE}")
    if figures["replies"] and figures["empty_share"] > limits.max_empty_share:
        crossed("empty-replies", f"{figures['empty_share']:.0%} of replies hold no text, only whitespace or special "
                f"tokens (threshold {limits.max_empty_share:.0%}): the target writes nothing readable; "
                f"{CHECK_TEMPLATE} (e.g. a generation prompt the target answers with its end token)")
    hit = figures["hit_limit_share"]
    if hit is not None and hit > limits.max_hit_limit_share:
        crossed("no-end-token", f"{hit:.0%} of replies hit max_new_tokens ({max_new_tokens}) without an end token "
                f"(threshold {limits.max_hit_limit_share:.0%}): the engine does not stop where the target ends its "
                "turn; check the stop tokens (generation_config.json eos_token_id), or raise data.max_new_tokens")
    if figures["duplicate_share"] > limits.max_duplicate_share:
        crossed("duplicate-replies", f"{figures['duplicate_share']:.0%} of replies repeat another reply word for word "
                f"(threshold {limits.max_duplicate_share:.0%}; one reply, {describe(figures['most_repeated_ids'])!r}"
                f"..., appears {figures['most_repeated_copies']} times): the target ignores the prompt; "
                f"{CHECK_TEMPLATE}")
    return found


def report(replies, limits: QualitySection, max_new_tokens: int | None, describe) -> dict:
    """{figures, problems, passed} of an iterable of replies: passed when every problem found is waived."""
    meter = Meter()
    for reply in replies:
        meter.add(reply)
    figures = meter.figures()
    found = problems(figures, limits, max_new_tokens, describe)
    return {"figures": figures, "thresholds": limits.model_dump(), "problems": found,
            "passed": all(p["waived"] for p in found)}


def refuse_failed(quality: dict, where: str) -> None:
    """Raise DataQualityError, in one line naming every unwaived problem, when the report failed."""
    failed = [p for p in quality["problems"] if not p["waived"]]
    if failed:
        raise DataQualityError(f"{where}: data quality check failed: " + "; ".join(p["message"] for p in failed)
                               + " (data.quality.waive accepts a code on purpose: "
                               + ", ".join(p["code"] for p in failed) + ")")


def describe_figures(figures: dict) -> str:
    """One line of the figures, for logs."""
    def share(value) -> str:
        return "n/a" if value is None else f"{value:.1%}"

    return (f"{figures['replies']:,} replies, {figures['tokens']:,} generated tokens; most frequent id "
            f"{figures['top_token_id']} takes {share(figures['top_token_share'])}; {NGRAM}-grams "
            f"{share(figures['distinct_ngram_ratio'])} distinct per reply; empty {share(figures['empty_share'])}; "
            f"hit max_new_tokens {share(figures['hit_limit_share'])}; duplicates {share(figures['duplicate_share'])}")
