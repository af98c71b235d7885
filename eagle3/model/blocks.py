"""What every kind of draft here is built from: the layers (RMSNorm, attention over blocks of keys and values with an
explicit mask, RoPE, the SwiGLU MLP), the target's frozen embedding as a draft module's base, the seeded init, and the
loss's parts (the rows it reads, the soft cross-entropy against the target's distribution, the per-prediction sums,
the module the parallel wrappers see). Each kind's own draft is in its folder (eagle3/algorithms/<name>/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle3.model.teacher import Teacher


class RMSNorm(nn.Module):
    recompute = True  # TargetEmbeddingDraft.set_recompute turns it off for the whole draft

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # its float32 intermediates (three tensors of x's size at 4 bytes) would be kept per call, several calls a training step
        return recomputed(self.normed, x) if self.recompute else self.normed(x)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype)).to(matmul_dtype(x))


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a matmul takes x in: autocast's where it is on (bf16 on a GPU), else x's own. A norm's output, which
    only ever feeds matmuls, is made in it at once rather than cast by autocast at each matmul (and each copy kept
    for the backward)."""
    kind = x.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = visible) as SDPA's additive mask: 0 where visible, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def recomputed(fn, *args: torch.Tensor) -> torch.Tensor:
    """fn(*args) whose intermediates the backward recomputes rather than keeps from the forward (only args are kept):
    for cheap elementwise work whose intermediates are large, and no randomness (no RNG state kept to replay). Equal
    results; no-grad calls (drafting, evaluation) run plainly."""
    if not torch.is_grad_enabled():
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama RoPE (rotate-half). x [B, heads, T, d], positions [T] (every row's) or [B, T] (each row its own)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d))  # [d/2]
    angles = positions.to(torch.float32)[..., None] * inv_freq  # [T, d/2] or [B, T, d/2]
    if angles.dim() == 3:
        angles = angles[:, None]  # [B, 1, T, d/2]: the same for every head
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()  # [T, d]
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class BlockAttention(nn.Module):
    """What every draft's attention shares: attention over blocks of keys and values with an explicit mask. A form
    gives `heads`, `kv_heads`, `o_proj` and `project`."""

    heads: int
    kv_heads: int
    o_proj: nn.Linear

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [B, heads, Tq, d]; keys/values [B, kv_heads, Tk, d]; mask [Tq, Tk] or [B, 1, Tq, Tk], True = visible."""
        return self.o_proj(self.attended_heads(q, keys, values, mask).flatten(2))

    def attended_heads(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor) -> torch.Tensor:
        """The attention's output per head, [B, Tq, heads, dv] (before o_proj). `mask` is a bool mask (True =
        visible) or an additive one already made (`attention_bias`), for callers that reuse one over many calls."""
        group = self.heads // self.kv_heads  # query heads g * group .. (g + 1) * group - 1 share kv head g
        # One call per position j in the group, over query heads j, group + j, ...: each sees the kv heads as they
        # are. Neither enable_gqa (with a mask, it sends CUDA to the math kernel, which materialises the scores) nor
        # keys and values repeated per query head (a copy per query chunk, kept for the backward), and the calls
        # share one additive mask.
        bias = attention_bias(mask, q.dtype) if mask.dtype == torch.bool else mask
        out = torch.stack([F.scaled_dot_product_attention(q[:, j::group], keys, values, attn_mask=bias)
                           for j in range(group)], dim=2)  # [B, kv_heads, group, Tq, d]
        return out.permute(0, 3, 1, 2, 4).flatten(2, 3)  # head g * group + j


class MLP(nn.Module):
    recompute = True  # TargetEmbeddingDraft.set_recompute turns it off for the whole draft

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # silu's output ([T, intermediate]) would be kept for the backward beside both inputs and the product
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(recomputed(swiglu, gate, up) if self.recompute else swiglu(gate, up))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class TargetEmbeddingDraft(nn.Module):
    """What every draft module here shares: the target's embedding as `embed_tokens`, frozen and never exported, and
    the norms and MLPs whose intermediates training.recompute keeps or recomputes (`DraftModel`'s members)."""

    embed_tokens: nn.Embedding

    def set_recompute(self, on: bool) -> None:
        """training.recompute: whether the backward recomputes the norms and the SwiGLU product (less memory, a
        slower step) or keeps their intermediates. The same values either way."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.recompute = on

    def load_draft_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load canonical tensors (every one but the target's embedding, which stays); strict otherwise."""
        self.load_state_dict({**tensors, "embed_tokens.weight": self.embed_tokens.weight}, strict=True)

    def export_state(self) -> dict[str, torch.Tensor]:
        """Canonical tensors (the native layout) on the CPU, without the target's embedding."""
        return {name: t.detach().to("cpu", copy=True) for name, t in self.state_dict().items()
                if not name.startswith("embed_tokens")}


def causal_mask(length: int, device=None) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool, device=device).tril()


def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic init of the trainable weights (Llama's normal(0, 0.02); norms, the only 1-D weights, at 1)."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        with torch.no_grad():
            if param.dim() == 1:
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)


@dataclass
class LossRows:
    """Where the loss reads, made on the host from the loss mask (static shapes on the device, no sync). Flat indices
    into B x T.

    Teacher row u (index i of its sequence) predicts token i + 1 and is scored when that token is loss-masked. Every
    prediction k (a draft's k-th step, or its block's k-th entry) scores those same rows: it reaches token i + 1 from
    index i - 1 - k, which exists when i >= 1 + k. So each prediction's logits line up with the teacher's rows as they
    are, and the loss gathers nothing the size of the draft vocabulary (a gather of [R, Dv] float32 probabilities per
    prediction, forward and backward, was ~10 % of a CPU step).
    """

    teacher: torch.Tensor  # [R] teacher rows u: index i in 1..T-2 whose token i + 1 is loss-masked
    steps: list[torch.Tensor]  # [R] per prediction: the index scored at row u, u - 1 - k (u itself where absent)
    present: list[torch.Tensor]  # [R] bool per prediction: i >= 1 + k, so the index exists

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
    prediction's logits from the forward to the backward (4 bytes per draft id and row, all steps at once); this keeps z
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


def step_stats(step_logits: Iterable[torch.Tensor], teacher: Teacher, rows: LossRows) -> StepStats:
    """Soft cross-entropy against the target's distribution restricted to the draft vocabulary.

    `teacher` is scored at `rows.teacher`; prediction k's logits at row u are the draft's at index u - 1 - k
    (`LossRows`). A row counts where that index exists and the target's argmax lies inside the draft vocabulary.
    `step_logits`: each prediction's logits at its rows [R, Dv] (scored as they come), or at every index [B, T, Dv]
    (gathered here). A prediction is right at a row when the draft's logit for the target's argmax is its largest (a
    tie counts).
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
