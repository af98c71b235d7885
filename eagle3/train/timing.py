"""Honest training timings: a step's wall time (after the GPU finished it) and tokens/s over recent steps only, so
evaluation and checkpoints never dilute the rate."""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, TypeVar

import torch

T = TypeVar("T")
THROUGHPUT_WINDOW = 20  # steps: tokens_per_s is over the last this many training steps


def timed(work: Callable[..., T], *args, device: torch.device | None = None) -> tuple[T, float]:
    """What `work(*args)` returns and its wall seconds; on a GPU the clock stops once the device finished its
    kernels."""
    started = time.monotonic()
    result = work(*args)
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, round(time.monotonic() - started, 4)


class Throughput:
    """Tokens per second over the last THROUGHPUT_WINDOW steps' own times."""

    def __init__(self, window: int = THROUGHPUT_WINDOW):
        self.steps: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)

    def add(self, tokens: int, seconds: float) -> float:
        """Count one step; return the window's tokens/s."""
        self.steps.append((tokens, seconds))
        return round(sum(n for n, _ in self.steps) / max(sum(s for _, s in self.steps), 1e-9), 1)
