"""Training-time feature noise (training.feature_noise): EAGLE's regulariser for a draft that only ever sees the
target's exact features in training but drafts on top of its own errors in serving, and for a small data set that it
would otherwise fit sample by sample (docs/training.md)."""

from __future__ import annotations

import torch


def noisy_features(aux: torch.Tensor, scale: float, layers: int) -> torch.Tensor:
    """aux [B, T, layers * H] -> aux + U(-scale, scale) x each layer's feature RMS at that position. Scaled per layer
    and position: the aux layers' magnitudes differ by orders (a late layer's residual stream against an early one's),
    so one absolute width would drown one layer and leave another untouched. Draws from the device's default
    generator (the CPU's is in every checkpoint)."""
    split = aux.unflatten(-1, (layers, -1))  # [B, T, layers, H]
    rms = split.float().pow(2).mean(-1, keepdim=True).sqrt()  # [B, T, layers, 1]
    noise = (torch.rand(split.shape, device=aux.device) * 2 - 1) * scale * rms
    return (split + noise.to(aux.dtype)).flatten(-2)
