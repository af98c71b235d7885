"""The target's next-token distribution the draft learns from, computed compactly from its last hidden state.

Training needs two things per position: the target's argmax over its whole vocabulary (a position
counts only when that token is in the draft vocabulary, and accuracy compares against it) and its
softmax over the draft-vocabulary ids. Full [B, T, V] logits are never made: at Kimi-K2.5's 163,840
ids, 8 x 4,096 tokens would take 10.7 GB in bf16. The argmax runs over lm_head's rows chunk by chunk
([B, T, TEACHER_CHUNK_ROWS] at a time) and the distribution needs only the draft rows ([B, T, Dv]).

Nor are positions the loss never reads: row i predicts token i + 1 and counts only when that token is loss-masked
(a generated one), so the trainer passes those rows (`LossRows.teacher`, from the loss mask on the host) and the head
scores only them. On SmolLM2's ShareGPT rows that is a quarter to a half of the positions, and the full-vocabulary
argmax was a third of the CPU step (docs/training.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

TEACHER_CHUNK_ROWS = 8192  # lm_head rows scored at once for the argmax


@dataclass
class Teacher:
    """The target at the positions scored: [B, T] (every position) or [R] (the loss's rows)."""

    argmax: torch.Tensor  # the target's greedy next token (row i predicts token i + 1)
    draft_argmax: torch.Tensor  # that token's draft-vocabulary row, -1 where it has none
    probs: torch.Tensor  # [..., Dv] float32 softmax over the draft-vocabulary logits

    @property
    def in_draft(self) -> torch.Tensor:
        """The greedy token is in the draft vocabulary."""
        return self.draft_argmax >= 0


class TeacherHead:
    """The target's head on the trainer's device: every row for the argmax, the draft rows for the
    distribution. `norm` (the target's final norm weight, float32) is applied first when the stored last
    hidden state is taken before it. `temperature` (training.teacher_temperature) divides the draft rows' logits
    before the softmax: below 1 the distribution leans toward the argmax, which greedy acceptance checks; the argmax
    itself (accuracy, which positions count) is the target's either way."""

    def __init__(self, lm_head: torch.Tensor, hot: torch.Tensor, norm: torch.Tensor | None = None, eps: float = 1e-6,
                 temperature: float = 1.0):
        self.lm_head = lm_head  # [V, H]
        self.hot_rows = lm_head.index_select(0, hot)  # [Dv, H]
        rows = torch.arange(len(hot), device=lm_head.device)
        self.draft_row = torch.full((lm_head.shape[0],), -1, device=lm_head.device).index_copy_(0, hot, rows)  # [V]
        self.norm, self.eps, self.temperature = norm, eps, temperature

    @torch.no_grad()
    def __call__(self, last: torch.Tensor, rows: torch.Tensor | None = None, argmax: torch.Tensor | None = None) -> Teacher:
        """last [B, T, H] -> the teacher at every position, or at `rows` [R] only (flat indices into B x T, on the
        head's device), as the loss reads it (`LossRows.teacher`). `argmax` [R]: the target's greedy tokens at the rows
        when already known (the full-vocabulary argmax is skipped; eagle3/train/argmax_memo.py)."""
        if rows is None:
            return self.scored(last)
        return self.scored(last.flatten(0, 1).index_select(0, rows), argmax)

    def scored(self, last: torch.Tensor, argmax: torch.Tensor | None = None) -> Teacher:
        """last [..., H] -> the teacher at every position given (`argmax` [...]: the greedy tokens, when known)."""
        last = last.float()
        if self.norm is not None:
            last = last * torch.rsqrt(last.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm
        last = last.to(self.lm_head.dtype)  # bf16 on a GPU, like the head
        if argmax is None:
            argmax = chunked_argmax(last, self.lm_head, TEACHER_CHUNK_ROWS)
        probs = F.softmax((last @ self.hot_rows.T).float() / self.temperature, dim=-1)  # [..., Dv]
        return Teacher(argmax=argmax, draft_argmax=self.draft_row[argmax], probs=probs)


def chunked_argmax(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """argmax over x @ weight.T (x [..., H], weight [V, H]) without making the [..., V] logits.
    Ties keep the lower id, as torch.argmax does."""
    best_value, best_index = None, None
    for start in range(0, weight.shape[0], rows):
        value, index = (x @ weight[start : start + rows].T).max(-1)  # [...]
        if best_value is None:
            best_value, best_index = value, index
            continue
        better = value > best_value
        best_value = torch.where(better, value, best_value)
        best_index = torch.where(better, index + start, best_index)
    return best_index
