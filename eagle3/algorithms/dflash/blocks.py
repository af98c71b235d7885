"""How a DFlash draft trains and drafts: blocks at anchors, each predicting its block in one forward.

A block anchored at position a holds x_a (known: the last verified token when serving) and block_size - 1 mask
tokens; it sees the target's features of positions 0..a-1, and its entry j predicts x_{a+j}. So its prediction k
(entry k + 1) reaches x_{a+1+k}: with a = t + 1 that is a draft's prediction k at index t (`eagle3.model.blocks.LossRows`),
and the teacher's rows, the step weights (training.ttt_step_decay: SpecForge's exp(-(k-1)/gamma) is a decay of
exp(-1/gamma), 0.8669 for its gamma 7) and the per-prediction metrics are the same as EAGLE-3's.

Training draws up to draft.dflash.num_anchors anchors per sequence among the positions whose block predicts some
generated token (all of them when there are fewer, as SpecForge does). The draw is seeded by the sequence's loss
mask, so the rows and the normaliser, made apart, agree, and a resumed run draws what the first one drew.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3.algorithms.dflash.model import DFlashDraft
from eagle3.algorithms.dflash.contract import dflash_shape_problem
from eagle3.model.teacher import Teacher
from eagle3.model.tree import DraftTree
from eagle3.model.blocks import LossModule, LossRows, StepStats, step_stats
from eagle3.shape import DraftShape


@dataclass
class BlockRows(LossRows):
    """LossRows whose per-prediction indices point into the blocks' outputs [B, N, K] (flat), and the anchors the
    blocks start at."""

    anchors: torch.Tensor  # [B, N] block start positions, a row's own padded with its first

    @classmethod
    def drawn(cls, loss_mask: torch.Tensor, predictions: int, most: int) -> BlockRows:
        """loss_mask [B, T] (host) -> the rows of blocks at up to `most` anchors per sequence."""
        batch, length = loss_mask.shape
        chosen = [anchors_of(loss_mask[b], predictions, most) for b in range(batch)]
        count = max(1, max(len(a) for a in chosen))
        anchors = torch.ones(batch, count, dtype=torch.long)  # a sequence without one keeps a block nobody reads
        slot = torch.full((batch, length + 1), -1, dtype=torch.long)  # position a -> its block's index in the row
        for b, row in enumerate(chosen):
            if len(row):
                anchors[b] = torch.cat([row, row[:1].expand(count - len(row))])
                slot[b, row] = torch.arange(len(row))
        every = LossRows.of(loss_mask, predictions)
        steps, present = [], []
        for k, (at, here) in enumerate(zip(every.steps, every.present)):
            b, position = at // length, at % length + 1  # EAGLE-3's index t is the block anchored at t + 1
            block = slot[b, position]
            here = here & (block >= 0)
            steps.append(torch.where(here, (b * count + block) * predictions + k, 0))
            present.append(here)
        reached = torch.stack(present).any(0)  # teacher rows some block's prediction scores
        return cls(every.teacher[reached], [s[reached] for s in steps], [p[reached] for p in present], anchors)

    def to(self, device: torch.device) -> BlockRows:
        rows = LossRows.to(self, device)
        return BlockRows(rows.teacher, rows.steps, rows.present, self.anchors.to(device, non_blocking=True))


def anchors_of(loss_mask: torch.Tensor, predictions: int, most: int) -> torch.Tensor:
    """[n <= most] ascending anchors of one sequence (loss_mask [T]): positions a in 1..T-2 whose block predicts a
    generated token (some of x_{a+1} .. x_{a+K} is loss-masked); a draw seeded by the mask when there are more."""
    length = loss_mask.numel()
    generated = torch.zeros(length + predictions + 1, dtype=torch.bool)
    generated[:length] = loss_mask.bool()
    positions = torch.arange(1, max(1, length - 1))  # a = 1 .. T - 2
    ahead = torch.stack([generated[positions + 1 + k] for k in range(predictions)]).any(0)
    candidates = positions[ahead]
    if len(candidates) <= most:
        return candidates
    seed = int((torch.arange(1, length + 1) * loss_mask.long()).sum())  # the mask's own: rows and normaliser agree
    order = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed))
    return candidates[order[:most]].sort().values


def block_outputs(model: DFlashDraft, aux: torch.Tensor, input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """aux [B, T, n * TH], input_ids [B, T], anchors [B, N] -> each block's predictions' stream [B * N * K, H]."""
    first = input_ids.gather(1, anchors)  # [B, N] the anchors' true tokens
    hidden = model.blocks(model.context(aux), first, anchors)  # [B, N, Bk, H]
    return hidden[:, :, 1:].flatten(0, 2)


def block_loss(model: DFlashDraft, aux: torch.Tensor, input_ids: torch.Tensor, teacher: Teacher,
               rows: BlockRows) -> StepStats:
    """The blocks scored at their rows against the teacher over the run's draft vocabulary: training's and
    evaluation's."""
    hidden = block_outputs(model, aux, input_ids, rows.anchors)  # [B * N * K, H]
    head = model.loss_head(hidden.dtype)  # [Dv, H]
    return step_stats((hidden.index_select(0, at) @ head.T for at in rows.steps), teacher, rows)


class BlockModel(LossModule):
    """The draft and its block loss."""

    @staticmethod
    def loss(draft: DFlashDraft, aux, input_ids, teacher, rows) -> StepStats:
        return block_loss(draft, aux, input_ids, teacher, rows)


class ContextCache:
    """A request's context keys and values as SGLang's worker keeps them: made once a position, as the verified prefix
    grows (a position's features never change once verified)."""

    def __init__(self, model: DFlashDraft):
        self.model = model
        self.context: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer [1, kv_heads, positions made, d]

    def prefix(self, aux: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """aux [P, n * TH] the features of x_0 .. x_{P-1} -> each layer's keys and values of those P positions."""
        p = aux.shape[0]
        made = self.context[0][0].shape[2] if self.context else 0
        if p > made:
            new = self.model.context(aux[None, made:p], start=made)
            self.context = new if not self.context else [
                (torch.cat([k, new_k], dim=2), torch.cat([v, new_v], dim=2))
                for (k, v), (new_k, new_v) in zip(self.context, new)]
        return [(k[:, :, :p], v[:, :, :p]) for k, v in self.context]


class BlockDrafter:
    """Drafting for one request as SGLang's DFLASH worker drafts: after the verified x_P, one forward of the block
    [x_P, mask, ...] of the served shape's num_draft_tokens at P over the context before P, each entry's greedy token
    over the target's whole head."""

    def __init__(self, model: DFlashDraft, shape: DraftShape):
        if problem := dflash_shape_problem(model.config.block_size, shape):
            raise ValueError(problem)
        self.model, self.shape, self.cache = model, shape, ContextCache(model)

    @torch.no_grad()  # drafting: no graph (the context kept across calls would hold one per step)
    def __call__(self, aux: torch.Tensor, tokens: torch.Tensor) -> DraftTree:
        """aux [P, n * TH] the features of x_0 .. x_{P-1}, tokens [P + 1] -> the chain after x_P."""
        p = aux.shape[0]
        anchor = torch.tensor([[p]], device=aux.device)
        first = tokens[p].view(1, 1).to(aux.device)
        hidden = self.model.blocks(self.cache.prefix(aux), first, anchor, self.shape.num_draft_tokens)[0, 0, 1:]
        return DraftTree.chain(self.model.greedy(hidden).tolist())  # hidden [num_steps, H]
