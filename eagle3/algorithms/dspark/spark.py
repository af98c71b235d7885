"""How a DSpark draft trains and drafts: DFlash's blocks at anchors, every entry predicting, its Markov head fed the
true previous tokens in training and its own drafts when drafting.

A block anchored at a holds x_a then gamma - 1 mask tokens; entry k predicts x_{a+1+k}, which is DFlash's prediction k
(its entry k + 1) of the same block: the rows (`BlockRows`, the anchors drawn as DFlash draws them), the teacher's
rows and the step weights (training.ttt_step_decay, the paper's exp(-(k-1)/gamma) as a per-step decay) are DFlash's.
Each prediction's loss (the objective of the DSpark paper and SpecForge's `OnlineDSparkModel`):

    ce_weight · H(q, p) + l1_weight · sum|p - q| + confidence_weight · BCE(conf, 1 - sum|p - q| / 2)

p the draft's softmax over the run's draft vocabulary with the Markov bias, q the target's there (the compact teacher
the trainer already has: no full-vocabulary softmax), the confidence target detached. SpecForge scores p against the
full vocabulary; here both are over the draft vocabulary, as every kind's loss is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eagle3.algorithms.dflash.blocks import BlockRows, ContextCache
from eagle3.algorithms.dspark.contract import dspark_shape_problem
from eagle3.algorithms.dspark.model import DSparkDraft
from eagle3.model.blocks import LossModule, SoftCrossEntropy, StepStats
from eagle3.model.teacher import Teacher
from eagle3.model.tree import DraftTree
from eagle3.shape import DraftShape


def previous_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, size: int) -> torch.Tensor:
    """[B, N, K] each entry's true previous token: x_{a+k} for entry k of the block at a (clamped past the end, where
    no row reads)."""
    positions = (anchors[:, :, None] + torch.arange(size, device=anchors.device)).clamp(max=input_ids.shape[1] - 1)
    return input_ids.gather(1, positions.flatten(1)).view(positions.shape)


def spark_loss(model: DSparkDraft, aux: torch.Tensor, input_ids: torch.Tensor, teacher: Teacher,
               rows: BlockRows) -> StepStats:
    """The blocks scored at their rows against the teacher over the run's draft vocabulary: training's and
    evaluation's. A prediction is right where its biased logit for the target's argmax is its largest."""
    cfg = model.config
    first = input_ids.gather(1, rows.anchors)  # [B, N] the anchors' true tokens
    hidden = model.blocks(model.context(aux), first, rows.anchors)  # [B, N, gamma, H]
    prev = previous_tokens(input_ids, rows.anchors, cfg.block_size)  # [B, N, gamma]
    latent = model.markov_head.latents(prev, hidden).flatten(0, 2)  # [B * N * gamma, r]
    hidden, prev = hidden.flatten(0, 2), prev.flatten()
    head = model.loss_head(hidden.dtype)  # [Dv, H]
    bias_rows = model.markov_head.markov_w2.weight.index_select(0, model.loss_ids)  # [Dv, r]
    target_row = teacher.draft_argmax.clamp_min(0)[:, None]
    losses, correct, count = [], [], []
    for at, present in zip(rows.steps, rows.present):
        h = hidden.index_select(0, at)  # [R, H]
        z = h @ head.T + (latent.index_select(0, at) @ bias_rows.T).to(h.dtype)  # [R, Dv]
        valid = present & teacher.in_draft
        l1 = (F.softmax(z.float(), -1) - teacher.probs).abs().sum(-1)  # [R] twice the total variation
        loss = cfg.ce_weight * SoftCrossEntropy.apply(z, teacher.probs) + cfg.l1_weight * l1
        if model.confidence_head is not None and cfg.confidence_weight > 0:
            logit = model.confidence_head(h, model.markov_head.markov_w1(prev.index_select(0, at)))
            survival = (1 - l1.detach() / 2).clamp(0, 1)
            loss = loss + cfg.confidence_weight * F.binary_cross_entropy_with_logits(logit.float(), survival,
                                                                                     reduction="none")
        losses.append((loss * valid).sum())
        correct.append(((z.gather(1, target_row)[:, 0] >= z.amax(-1)) & valid).sum())
        count.append(valid.sum())
    return StepStats(torch.stack(losses), torch.stack(correct).float(), torch.stack(count).float())


class SparkModel(LossModule):
    """The draft and its DSpark loss."""

    @staticmethod
    def loss(draft: DSparkDraft, aux, input_ids, teacher, rows) -> StepStats:
        return spark_loss(draft, aux, input_ids, teacher, rows)


class SparkDrafter:
    """Drafting for one request as SGLang's DSPARK worker drafts greedily: after the verified x_P, one backbone forward
    of the block [x_P, mask, ...] of the served shape's num_steps entries at P, then its tokens left to right, each
    biased by the one drafted before (`DSparkDraft.draft_block`)."""

    def __init__(self, model: DSparkDraft, shape: DraftShape):
        if problem := dspark_shape_problem(model.config.block_size, shape):
            raise ValueError(problem)
        self.model, self.shape, self.cache = model, shape, ContextCache(model)

    @torch.no_grad()
    def __call__(self, aux: torch.Tensor, tokens: torch.Tensor) -> DraftTree:
        """aux [P, n * TH] the features of x_0 .. x_{P-1}, tokens [P + 1] -> the chain after x_P."""
        p = aux.shape[0]
        anchor = torch.tensor([[p]], device=aux.device)
        first = tokens[p].view(1, 1).to(aux.device)
        hidden = self.model.blocks(self.cache.prefix(aux), first, anchor, self.shape.num_steps)[0, 0]  # [gamma, H]
        return DraftTree.chain(self.model.draft_block(hidden, int(first)))
