"""Training-time test (TTT) and chain drafting, with one alignment (docs/contracts.md):

    step 0, index t:  f_t = fc(aux_t) with embed(x_{t+1})  ->  predicts x_{t+2}
    step k, index t:  h^{k-1}_t (the draft's own pre-norm output) with embed(x_{t+1+k})  ->  x_{t+2+k}

Step k of the chain rooted at t sits at sequence position t + k. Its attention sees what inference
sees: the step-0 entries of every index s <= t (the prefix, built from target features) and the
chain's own entries of steps 1..k at index t. Training feeds the true tokens x_{t+1+k}; drafting
feeds the draft's own predictions. The simulator and the reference server draft with
`eagle3.algorithms.eagle3.tree.draft_tree` (of which `draft_chain` is the topk-1 case), so training and serving cannot
drift apart.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from eagle3.algorithms.eagle3.model import Eagle3Draft
from eagle3.algorithms.eagle3.tree import draft_tree
from eagle3.model.blocks import LossModule, LossRows, StepStats, step_stats
from eagle3.model.teacher import Teacher
from eagle3.shape import DraftShape


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, i] <- x[:, i + n] along dim 1, zero-filled at the end."""
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def ttt_outputs(model: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
    """aux [B, T, n_aux * TH], input_ids [B, T] -> each step's pre-norm output [B, T, H], made as it is asked for:
    `step_stats` scores each step before the next runs, so the backward (which takes the most recent work first) frees
    each step's logits gradient before it makes the previous step's."""
    length = input_ids.shape[1]
    index = torch.arange(length, device=input_ids.device)
    hidden = model.fuse(aux)  # [B, T, H]
    keys, values = [], []
    for k in range(steps):
        q, new_k, new_v = model.project(shift_left(input_ids, 1 + k), hidden, index + k)
        keys.append(new_k)
        values.append(new_v)
        hidden = model.output(hidden, model.midlayer.self_attn.attend_ttt(q, keys, values))
        yield hidden


def ttt_steps(model: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
    """Each step's logits [B, T, draft_vocab] at every index (`ttt_outputs`)."""
    return (model.logits(hidden) for hidden in ttt_outputs(model, aux, input_ids, steps))


def ttt_forward(model: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Every step's logits at once (`ttt_steps`)."""
    return list(ttt_steps(model, aux, input_ids, steps))


def row_logits(step_outputs: Iterable[torch.Tensor], rows: LossRows, model: Eagle3Draft) -> Iterator[torch.Tensor]:
    """Each step's logits [R_k, Dv] at its loss rows only (the head and the loss skip the rest: prompts, padding)."""
    for hidden, at in zip(step_outputs, rows.steps):
        yield model.lm_head(model.head_input(hidden).flatten(0, 1).index_select(0, at))


def draft_chain(model: Eagle3Draft, aux: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[int]:
    """Propose `steps` target ids after a verified prefix: the tree with topk 1 (`eagle3.model.tree`).

    aux [P, n_aux * TH]: target features of positions 0..P-1; tokens [P + 1]: x_0..x_P, where x_P is
    the last verified token (the bonus token). Returns the drafts for x_{P+1} .. x_{P+steps}; a draft
    outside the target vocabulary (a d2t that is not offsets) ends the chain, the rest are -1.
    """
    drafts = draft_tree(model, aux, tokens, DraftShape(steps)).tokens
    vocab = model.embed_tokens.num_embeddings
    broken = next((i for i, t in enumerate(drafts) if not 0 <= t < vocab), steps - 1)
    return drafts[: broken + 1] + [-1] * (steps - broken - 1)


class TTTModel(LossModule):
    """The unrolled draft and its training-time-test loss."""

    @staticmethod
    def loss(draft: Eagle3Draft, aux, input_ids, teacher, rows) -> StepStats:
        return ttt_loss(draft, aux, input_ids, teacher, rows)


def ttt_loss(model: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor, teacher: Teacher, rows: LossRows) -> StepStats:
    """The TTT forward scored at the loss rows: the training step's and evaluation's."""
    steps = len(rows.steps)
    return step_stats(row_logits(ttt_outputs(model, aux, input_ids, steps), rows, model), teacher, rows)


def target_positions(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """[K] positions per TTT step whose target token is loss-masked (step k at index t predicts x_{t+2+k}, as in
    step_stats): the loss's normaliser, known from the token rows alone, before the target or the draft runs."""
    return torch.stack([loss_mask[:, 2 + k :].sum() for k in range(steps)]).float()
