"""How SGLang grows, finishes and counts one request under speculative decoding (chain or tree), by release.

The reference server and the simulator count through `SpecRequest`, so their numbers are SGLang's;
tests/conformance/test_counting.py feeds the same token runs to each release's own scheduler and
tokenizer-manager code and compares every field. Read there (docs/contracts.md, Acceptance):

- A verify step yields a run: the accepted drafts, then the target's bonus token. The whole run is
  appended and the finish is checked once over it; tokens past the finish are not emitted.
- Every accepted draft counts as correct, on the finishing step too, also past EOS or the length cap.
- Up to 0.5.17 the length cap is checked first (an EOS inside a run that crosses max_new_tokens ends the
  request as "length", keeping the tokens after the EOS); from 0.5.18 a stop token is checked first.
- Some methods' workers, in some releases, append a run token by token, checking the finish after each: the tokens
  after the finishing one are never appended, and only the appended drafts count as correct (a finishing step counts
  its kept run - 1); no histogram is kept. SGLang's table says which, by method and release
  (`eagle3.serving.sglang.WHOLE_RUN_FROM`); the others hand the scheduler the whole run, counted as EAGLE's is.
- spec_accept_length = completion_tokens / verify steps (the prefill token included);
  spec_accept_rate = correct drafts / (verify steps x (num_draft_tokens - 1)): the tree's draft nodes, which
  for a chain are its num_steps; the histogram is indexed by the drafts accepted in a step (the accepted
  path's length, for a tree) and grows only as far as needed. No spec_* key without a verify step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import zip_longest
from typing import Iterable

from eagle3.contract.releases import release_or_newest
from eagle3.serving.sglang import appends_token_by_token

EOS_FIRST_FROM = (0, 5, 18)  # Req.update_finish_state checks stop tokens before the length cap
NEW_KEYS_FROM = (0, 5, 12)  # spec_num_correct_drafts, spec_num_proposed_drafts, spec_correct_drafts_histogram
OLD_KEYS_UNTIL = (0, 5, 20)  # spec_accepted_drafts, spec_proposed_drafts, spec_accept_histogram (aliases from 0.5.12)


@dataclass
class SpecRequest:
    max_new_tokens: int
    eos_ids: frozenset[int]
    release: str | None = None
    method: str | None = None  # SGLang's --speculative-algorithm (served_as["sglang"]): how its worker hands a verify
    # step over (None: a draft no SGLang method serves, counted as EAGLE's)
    output: list[int] = field(default_factory=list)
    finish: dict | None = None  # SGLang's finish_reason once finished
    verify_ct: int = 0
    correct: int = 0
    histogram: list[int] = field(default_factory=list)  # verify steps by drafts accepted

    def add_token(self, token: int) -> None:
        """The prefill's token, or one step of plain decoding: no verify step."""
        self._append([token])

    def add_verify(self, run: list[int]) -> None:
        """One verify step: `run` is the accepted drafts followed by the bonus token."""
        self.verify_ct += 1
        if appends_token_by_token(self.method, self.release):
            self._append_token_by_token(run)
            return
        accepted = len(run) - 1
        self.correct += accepted
        self.histogram += [0] * (accepted + 1 - len(self.histogram))
        self.histogram[accepted] += 1
        self._append(run)

    def _append_token_by_token(self, run: list[int]) -> None:
        appended = 0
        for token in run:
            self._append([token])
            appended += 1
            if self.finish is not None:
                break
        self.correct += appended - 1

    def _append(self, tokens: list[int]) -> None:
        start, cap = len(self.output), self.max_new_tokens
        self.output += tokens
        stop = next((start + i + 1 for i, t in enumerate(tokens) if t in self.eos_ids), None)  # kept length
        if stop is not None and release_or_newest(self.release) >= EOS_FIRST_FROM and stop <= cap:
            self._finish(stop, {"type": "stop", "matched": self.output[stop - 1]})
        elif len(self.output) >= cap:
            self._finish(cap, {"type": "length", "length": cap})
        elif stop is not None:
            self._finish(stop, {"type": "stop", "matched": self.output[stop - 1]})

    def _finish(self, kept: int, reason: dict) -> None:
        del self.output[kept:]
        self.finish = reason

    def meta_info(self, drafts_per_step: int) -> dict:
        """The spec_* keys SGLang's tokenizer manager adds for this release ({} without a verify step; no histogram
        key for an empty histogram, as a token-by-token worker leaves it); drafts_per_step: num_draft_tokens - 1."""
        if not self.verify_ct:
            return {}
        release, proposed = release_or_newest(self.release), self.verify_ct * drafts_per_step
        meta = {"spec_verify_ct": self.verify_ct, "spec_accept_length": accept_length(len(self.output), self.verify_ct),
                "spec_accept_rate": accept_rate(self.correct, self.verify_ct, drafts_per_step)}
        if release >= NEW_KEYS_FROM:
            meta |= {"spec_num_correct_drafts": self.correct, "spec_num_proposed_drafts": proposed,
                     "spec_correct_drafts_histogram": list(self.histogram)}
        if release <= OLD_KEYS_UNTIL:
            meta |= {"spec_accepted_drafts": self.correct, "spec_proposed_drafts": proposed,
                     "spec_accept_histogram": list(self.histogram)}
        return {key: value for key, value in meta.items() if self.histogram or not key.endswith("_histogram")}


def accept_length(completion_tokens: int, verify_ct: int) -> float | None:
    """Completion tokens per verify step, the prefill's token included; None without a verify step, as SGLang then
    reports no spec_* key."""
    return completion_tokens / verify_ct if verify_ct else None


def accept_rate(correct: int, verify_ct: int, drafts_per_step: int) -> float | None:
    """Correct drafts over the drafts verified: verify steps x drafts_per_step (num_draft_tokens - 1); None without
    a verify step."""
    return correct / (verify_ct * drafts_per_step) if verify_ct else None


def sum_histograms(histograms: Iterable[list[int]]) -> list[int]:
    """Requests' histograms added bucket by bucket; each is only as long as its largest bucket seen."""
    return [sum(column) for column in zip_longest(*histograms, fillvalue=0)]


def correct_drafts_of(meta: dict) -> int | None:
    """A request's correct drafts under either release's key name."""
    return meta.get("spec_num_correct_drafts", meta.get("spec_accepted_drafts"))


def histogram_of(meta: dict) -> list[int] | None:
    return meta.get("spec_correct_drafts_histogram", meta.get("spec_accept_histogram"))


def server_accept_length(correct: int, verify_ct: int) -> float:
    """/server_info's avg_spec_accept_length: accepted tokens per verify step, the bonus included
    (correct drafts + 1 per step; the prefill token is no part of it)."""
    return (correct + verify_ct) / verify_ct


def figures(rows: list[dict], drafts_per_step: int | None) -> dict:
    """Requests' counts summed and turned into accept length and rate as the whole is (rows: completion_tokens,
    verify_ct, correct_drafts - None where the server reported no count)."""
    return pooled([{**r, "requests": 1} for r in rows], drafts_per_step)


def pooled(parts: list[dict], drafts_per_step: int | None) -> dict:
    """Figures of several parts (requests, or suites' figures) counted as one whole: their requests, completion
    tokens, verify steps and correct drafts summed."""
    completion, verify = sum(p["completion_tokens"] for p in parts), sum(p["verify_ct"] for p in parts)
    corrects = [p["correct_drafts"] for p in parts]
    correct = None if None in corrects else sum(corrects)
    rate = accept_rate(correct, verify, drafts_per_step) if correct is not None and drafts_per_step else None
    return {"requests": sum(p["requests"] for p in parts), "completion_tokens": completion, "verify_ct": verify,
            "correct_drafts": correct, "accept_length": accept_length(completion, verify), "accept_rate": rate}


def by_suite(rows: list[dict], drafts_per_step: int | None) -> dict:
    """{suite: figures, with `slices`: {slice: figures}} over requests labelled `suite` and `slice`, in first-seen
    order: each suite and each slice inside it counted as SGLang counts the whole."""
    suites: dict[str, dict[str, list[dict]]] = {}
    for row in rows:
        suites.setdefault(row["suite"], {}).setdefault(row["slice"], []).append(row)
    return {name: {**figures([r for group in slices.values() for r in group], drafts_per_step),
                   "slices": {s: figures(group, drafts_per_step) for s, group in slices.items()}}
            for name, slices in suites.items()}
