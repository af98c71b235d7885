"""The optimizer and its learning-rate schedule, as training.* sets them (docs/training.md)."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR


def lr_factor(step: int, warmup: int, total: int, floor: float, warmup_start: str) -> float:
    """Linear warmup (from 1/warmup of the peak at step 0: lr_over_warmup, or from 0: zero), then cosine decay to
    `floor` of the peak (training.warmup_start, training.lr_floor)."""
    if step < warmup:
        return (step + (warmup_start == "lr_over_warmup")) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_and_schedule(model: torch.nn.Module, train) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """AdamW over the model's trainable parameters (frozen ones, training.freeze_head's, are left out) and its
    learning-rate schedule, as training.* sets them."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=train.learning_rate, betas=train.adam_betas, weight_decay=train.weight_decay)
    return optimizer, LambdaLR(optimizer, lambda step: lr_factor(step, train.warmup_steps, train.max_steps,
                                                                train.lr_floor, train.warmup_start))
