"""The shape of speculative drafting, as SGLang's flags name it; torch-free, so the config can check it."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_NUM_STEPS = 3  # serving.num_steps' default; also what a conversion told no serving shape writes


@dataclass(frozen=True)
class DraftShape:
    """SGLang's --speculative-num-steps, --speculative-eagle-topk, --speculative-num-draft-tokens."""

    num_steps: int
    eagle_topk: int = 1
    num_draft_tokens: int | None = None  # None: num_steps + 1, the chain

    def __post_init__(self):
        if self.num_draft_tokens is None:
            object.__setattr__(self, "num_draft_tokens", self.num_steps + 1)
        problem = shape_problem(self.num_steps, self.eagle_topk, self.num_draft_tokens)
        if problem:
            raise ValueError(problem)

    @classmethod
    def of(cls, fields: dict) -> DraftShape:
        """The shape recorded in a mapping that may hold more (a version's `serving`)."""
        return cls(fields["num_steps"], fields["eagle_topk"], fields["num_draft_tokens"])

    @property
    def drafts_per_step(self) -> int:
        """Draft nodes verified per step: the accept rate's denominator."""
        return self.num_draft_tokens - 1

    def label(self) -> str:
        return f"steps {self.num_steps}, topk {self.eagle_topk}, draft tokens {self.num_draft_tokens}"


def shape_problem(num_steps: int, topk: int, num_draft_tokens: int) -> str | None:
    """Why SGLang cannot draft this tree (None when it can): with topk 1 it is a chain of num_steps + 1 tokens;
    a tree holds at most topk + (num_steps - 1) * topk^2 candidates besides the root."""
    if num_steps < 1 or topk < 1:
        return f"num_steps {num_steps} and eagle_topk {topk} must be at least 1"
    if topk == 1 and num_draft_tokens != num_steps + 1:
        return (f"with eagle_topk 1 (chain drafting) num_draft_tokens must be num_steps + 1 = {num_steps + 1}, "
                f"got {num_draft_tokens}")
    most = topk + (num_steps - 1) * topk * topk + 1
    if not 2 <= num_draft_tokens <= most:
        return (f"num_draft_tokens {num_draft_tokens} must be in [2, {most}]: the root and at most eagle_topk + "
                f"(num_steps - 1) x eagle_topk^2 drafted candidates")
    return None
