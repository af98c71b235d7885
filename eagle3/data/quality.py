"""Data quality: the signs of a target that is not really answering, measured on the replies it generated.

A draft trained on degenerate replies learns them perfectly (a target that writes one token forever gives a
simulated accept length at the physical limit), so nothing downstream would notice. Measured per set of replies:
- the share of generated tokens taken by the most frequent id (a target repeating one token);
- replies that loop: the tail of a reply repeating a span (few distinct bigrams in its last tokens), as a share
  of replies, whether or not the loop ran into max_new_tokens;
- replies with no text, only whitespace or special tokens (a stop token the target writes first);
- replies that hit max_new_tokens without an end token and without looping (a stop token the engine does not
  know: a looping reply would not have ended either, so it is counted as a loop, not here);
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

from eagle3.config.data import QualitySection
from eagle3.data.prompts import file_records, parse_turns
from eagle3.errors import Eagle3Error, UnreadableInput

# Bigrams, not longer n-grams: a loop that counts ("1. **Segment**", "2. **Segment**") or indents deeper at every
# turn changes each 4-gram that holds the counter, but only two of its bigrams. On 50 SmolLM2 replies to ShareGPT
# prompts, bigrams under 50 % distinct in the last 64 ids flagged 8 replies, all run into max_new_tokens, none that
# ended its turn; 4-grams missed the counting and indenting loops.
LOOP_NGRAM = 2
MIN_LOOP_TOKENS = 16  # a shorter reply is never called a loop
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

    def __init__(self, limits: QualitySection):
        self.limits = limits
        self.counts: Counter[int] = Counter()  # generated tokens by id
        self.replies = self.empty = self.hit_limit = self.limit_known = self.looping = self.looping_at_limit = 0
        self.unended = 0  # hit the limit without looping: the only replies a missing stop token explains
        self.copies: Counter[bytes] = Counter()  # reply digest -> how many replies have exactly those ids
        self.openings: dict[bytes, tuple[int, ...]] = {}  # reply digest -> its first ids, to show a repeated one

    def add(self, reply: Reply) -> None:
        self.replies += 1
        self.counts.update(reply.ids)
        empty = not reply.text.strip()
        # a reply of newlines repeats its bigrams too, but its defect is having no text: counted as empty only
        loops = not empty and reply_loops(reply.ids, self.limits.loop_window, self.limits.loop_min_distinct)
        self.looping += loops
        self.empty += empty
        if reply.hit_limit is not None:
            self.limit_known += 1
            self.hit_limit += reply.hit_limit
            self.looping_at_limit += reply.hit_limit and loops
            self.unended += reply.hit_limit and not loops
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
            "looping_share": self.looping / n,
            "empty_share": self.empty / n,
            "hit_limit_share": self.hit_limit / self.limit_known if self.limit_known else None,
            "looping_at_limit_share": self.looping_at_limit / self.limit_known if self.limit_known else None,
            "unended_share": self.unended / self.limit_known if self.limit_known else None,
            "duplicate_share": (self.replies - len(self.copies)) / n,
            "most_repeated_copies": copies,
            "most_repeated_ids": list(self.openings.get(repeated, ())),
        }


def replies_in_file(path: Path, encode) -> Iterator[Reply]:
    """The assistant turns of a file of conversations (ShareGPT or OpenAI messages, JSONL or a JSON array) as
    replies, tokenized with `encode(text)`; whether a reply hit a token limit is not known from text."""
    for number, line in enumerate(file_records(Path(path)), start=1):  # a missing or non-UTF-8 file is named
        if isinstance(line, str) and not line.strip():
            continue
        try:
            turns = parse_turns(line)
        except ValueError as err:
            raise UnreadableInput(f"{path}:{number}: {err}") from None
        for turn in turns:
            if turn["role"] == "assistant":
                yield Reply(tuple(encode(turn["content"])), turn["content"], None)


def reply_loops(ids: tuple[int, ...], window: int, min_distinct: float) -> bool:
    """Whether the reply's last `window` ids repeat a span: fewer than `min_distinct` of their bigrams distinct.
    A span of p ids repeated over the window gives p distinct bigrams whatever the window, so p / window measures
    the loop."""
    tail = ids[-window:]
    grams = list(zip(*(tail[k:] for k in range(LOOP_NGRAM))))  # zip stops at the last whole n-gram
    return len(tail) >= MIN_LOOP_TOKENS and len(set(grams)) / len(grams) < min_distinct


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
    looping, at_limit = figures["looping_share"], figures["looping_at_limit_share"]
    if figures["replies"] and looping > limits.max_looping_share:
        ran_out = "" if at_limit is None else f", {at_limit:.0%} of all replies running into max_new_tokens that way"
        crossed("looping", f"{looping:.0%} of replies loop: their last {limits.loop_window} tokens repeat a span "
                f"(under {limits.loop_min_distinct:.0%} of the bigrams distinct; threshold "
                f"{limits.max_looping_share:.0%} of replies{ran_out}): the target's own decoding repeats itself, not "
                "a stop token; small models do at temperature 0: sample (data.temperature) or pick a larger target")
    if figures["replies"] and figures["empty_share"] > limits.max_empty_share:
        crossed("empty-replies", f"{figures['empty_share']:.0%} of replies hold no text, only whitespace or special "
                f"tokens (threshold {limits.max_empty_share:.0%}): the target writes nothing readable; "
                f"{CHECK_TEMPLATE} (e.g. a generation prompt the target answers with its end token)")
    unended = figures["unended_share"]
    if unended is not None and unended > limits.max_hit_limit_share:
        ended = 1 - figures["hit_limit_share"]
        cause = (f"{ended:.0%} of replies did end their turn, so the stop tokens work: the answers are longer than "
                 "data.max_new_tokens (raise it)" if ended else "no reply ended its turn: the engine does not stop "
                 "where the target ends it; check the stop tokens (generation_config.json eos_token_id)")
        crossed("no-end-token", f"{unended:.0%} of replies hit max_new_tokens ({max_new_tokens}) without an end token "
                f"and without looping (threshold {limits.max_hit_limit_share:.0%}): {cause}")
    if figures["duplicate_share"] > limits.max_duplicate_share:
        crossed("duplicate-replies", f"{figures['duplicate_share']:.0%} of replies repeat another reply word for word "
                f"(threshold {limits.max_duplicate_share:.0%}; one reply, {describe(figures['most_repeated_ids'])!r}"
                f"..., appears {figures['most_repeated_copies']} times): the target ignores the prompt; "
                f"{CHECK_TEMPLATE}")
    return found


def report(replies, limits: QualitySection, max_new_tokens: int | None, describe) -> dict:
    """{figures, problems, passed} of an iterable of replies: passed when every problem found is waived."""
    meter = Meter(limits)
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
            f"{figures['top_token_id']} takes {share(figures['top_token_share'])}; looping "
            f"{share(figures['looping_share'])}; empty {share(figures['empty_share'])}; hit max_new_tokens "
            f"{share(figures['hit_limit_share'])} (looping {share(figures['looping_at_limit_share'])}, neither looping "
            f"nor ending {share(figures['unended_share'])}); duplicates {share(figures['duplicate_share'])}")
