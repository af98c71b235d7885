"""Training-time test (TTT) and chain drafting, with one alignment (docs/contracts.md):

    step 0, index t:  f_t = fc(aux_t) with embed(x_{t+1})  ->  predicts x_{t+2}
    step k, index t:  h^{k-1}_t (the draft's own pre-norm output) with embed(x_{t+1+k})  ->  x_{t+2+k}

Step k of the chain rooted at t sits at sequence position t + k. Its attention sees what inference
sees: the step-0 entries of every index s <= t (the prefix, built from target features) and the
chain's own entries of steps 1..k at index t. Training feeds the true tokens x_{t+1+k}; drafting
feeds the draft's own predictions. The simulator and the reference server draft with
`eagle3.model.tree.draft_tree` (of which `draft_chain` is the topk-1 case), so training and serving cannot
drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from eagle3.model.draft import Eagle3Draft
from eagle3.model.teacher import Teacher
from eagle3.model.tree import DraftShape, draft_tree


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, i] <- x[:, i + n] along dim 1, zero-filled at the end."""
    out = torch.zeros_like(x)
    if n < x.shape[1]:
        out[:, : x.shape[1] - n] = x[:, n:]
    return out


def ttt_outputs(model: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
    """aux [B, T, n_aux * TH], input_ids [B, T] -> each step's pre-norm output [B, T, H], made as it is asked for:
    `ttt_stats` scores each step before the next runs, so the backward (which takes the most recent work first) frees
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


@dataclass
class LossRows:
    """Where the loss reads, made on the host from the loss mask (static shapes on the device, no sync). Flat indices
    into B x T.

    Teacher row u (index i of its sequence) predicts token i + 1 and is scored when that token is loss-masked. Every
    TTT step scores those same rows: step k reaches token i + 1 from index i - 1 - k, which exists when i >= 1 + k. So
    each step's logits line up with the teacher's rows as they are, and the loss gathers nothing the size of the draft
    vocabulary (a gather of [R, Dv] float32 probabilities per step, forward and backward, was ~10 % of a CPU step).
    """

    teacher: torch.Tensor  # [R] teacher rows u: index i in 1..T-2 whose token i + 1 is loss-masked
    steps: list[torch.Tensor]  # [R] per step: the index scored at row u, u - 1 - k (u itself where absent)
    present: list[torch.Tensor]  # [R] bool per step: i >= 1 + k, so the index exists

    @classmethod
    def of(cls, loss_mask: torch.Tensor, steps: int) -> LossRows:
        """loss_mask [B, T] (host)."""
        batch, length = loss_mask.shape
        scored = torch.zeros(batch, length, dtype=torch.bool)
        scored[:, 1 : length - 1] = loss_mask[:, 2:].bool()  # row 0 is reached by no step: it would need index -1
        teacher = torch.arange(batch * length).view(batch, length)[scored]
        index = torch.arange(length).expand(batch, length)[scored]
        present = [index >= 1 + k for k in range(steps)]
        return cls(teacher, [torch.where(here, teacher - 1 - k, teacher) for k, here in enumerate(present)], present)

    def to(self, device: torch.device) -> LossRows:
        def moved(tensors):
            return [t.to(device, non_blocking=True) for t in tensors]
        return LossRows(self.teacher.to(device, non_blocking=True), moved(self.steps), moved(self.present))


@dataclass
class StepStats:
    """Per-step sums over the local batch; the trainer all-reduces them before normalising."""

    loss_sum: torch.Tensor  # [K] soft cross-entropy summed over valid positions (differentiable)
    correct: torch.Tensor  # [K] top-1 agreement with the target's argmax
    count: torch.Tensor  # [K] valid positions


class SoftCrossEntropy(torch.autograd.Function):
    """Per row, -(p * log_softmax(z)).sum(-1) = logsumexp(z) - p.z (p sums to 1), computed in float32.

    logits z [R, Dv] in their own dtype, probs p [R, Dv] float32 -> [R]. Autograd would keep a float32 copy of every
    TTT step's logits from the forward to the backward (4 bytes per draft id and row, all steps at once); this keeps z
    as it came (2 bytes in bf16, and the caller holds it anyway) and recomputes the gradient, softmax(z) - p, in the
    backward.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(logits, probs)
        z = logits.float()
        return torch.logsumexp(z, dim=-1) - (probs * z).sum(-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, probs = ctx.saved_tensors
        g = torch.softmax(logits.float(), dim=-1).sub_(probs)  # softmax(z) - p, in place
        return g.mul_(grad[..., None]).to(logits.dtype), None


def row_logits(step_outputs: Iterable[torch.Tensor], rows: LossRows, model: Eagle3Draft) -> Iterator[torch.Tensor]:
    """Each step's logits [R_k, Dv] at its loss rows only (the head and the loss skip the rest: prompts, padding)."""
    for hidden, at in zip(step_outputs, rows.steps):
        yield model.lm_head(model.head_input(hidden).flatten(0, 1).index_select(0, at))


def ttt_stats(step_logits: Iterable[torch.Tensor], teacher: Teacher, rows: LossRows) -> StepStats:
    """Soft cross-entropy against the target's distribution restricted to the draft vocabulary.

    `teacher` is scored at `rows.teacher`; step k's logits at row u are the draft's at index u - 1 - k (`LossRows`).
    A row counts where that index exists and the target's argmax lies inside the draft vocabulary. `step_logits`: each
    step's logits at its rows [R, Dv] (`row_logits`, scored as they come), or at every index [B, T, Dv] (gathered
    here). A step is right at a row when the draft's logit for the target's argmax is its largest (a tie counts).
    """
    target_row = teacher.draft_argmax.clamp_min(0)[:, None]  # [R, 1] the draft row of the target's argmax
    losses, correct, count = [], [], []
    for z, at, present in zip(step_logits, rows.steps, rows.present):
        if z.dim() == 3:
            z = z.flatten(0, 1).index_select(0, at)  # [R, Dv], in the head's dtype (bf16 on a GPU)
        valid = present & teacher.in_draft
        losses.append((SoftCrossEntropy.apply(z, teacher.probs) * valid).sum())
        # no argmax over Dv: on the CPU it costs as much as the loss itself, a row's max a tenth of it
        correct.append(((z.gather(1, target_row)[:, 0] >= z.amax(-1)) & valid).sum())
        count.append(valid.sum())
    return StepStats(torch.stack(losses), torch.stack(correct).float(), torch.stack(count).float())


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


class LossModule(torch.nn.Module):
    """A draft and its loss as one module, so DDP and FSDP see a forward call (and sync gradients). A subclass names
    the loss: loss(draft, aux, input_ids, teacher, rows) -> StepStats."""

    loss: Callable[..., StepStats]

    def __init__(self, draft: torch.nn.Module):
        super().__init__()
        self.draft = draft

    def forward(self, aux: torch.Tensor, input_ids: torch.Tensor, teacher: Teacher, rows: LossRows) -> torch.Tensor:
        """[3, K]: StepStats' loss_sum, correct and count stacked (a tensor, which the wrappers' hooks follow)."""
        stats = type(self).loss(self.draft, aux, input_ids, teacher, rows)
        return torch.stack([stats.loss_sum, stats.correct, stats.count])


class TTTModel(LossModule):
    """The unrolled draft and its training-time-test loss."""

    @staticmethod
    def loss(draft: Eagle3Draft, aux, input_ids, teacher, rows) -> StepStats:
        return ttt_loss(draft, aux, input_ids, teacher, rows)


def ttt_loss(model: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor, teacher: Teacher, rows: LossRows) -> StepStats:
    """The TTT forward scored at the loss rows: the training step's and evaluation's."""
    steps = len(rows.steps)
    return ttt_stats(row_logits(ttt_outputs(model, aux, input_ids, steps), rows, model), teacher, rows)


def target_positions(loss_mask: torch.Tensor, steps: int) -> torch.Tensor:
    """[K] positions per TTT step whose target token is loss-masked (step k at index t predicts x_{t+2+k}, as in
    ttt_stats): the loss's normaliser, known from the token rows alone, before the target or the draft runs."""
    return torch.stack([loss_mask[:, 2 + k :].sum() for k in range(steps)]).float()
