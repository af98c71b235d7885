"""The time plan's clock (eagle3/plan_time.py): seconds of prefill, decode, training FLOPs and server starts on the
node's GPUs, from node.peak_tflops, node.hbm_tbps, node.mfu and node.model_load_min, and the target's shape."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.config.node import NodeSection
from eagle3.target.info import TargetSize


@dataclass(frozen=True)
class Target:
    """What the target's time rests on: parameters multiplied per token, bytes read per decode step."""

    active: int
    total: int
    size: TargetSize
    source: Path  # the config.json the counts come from


class Clock:
    """Seconds of each kind of work on `gpus` GPUs of the node."""

    def __init__(self, node: NodeSection, target: Target | None):
        self.node, self.target = node, target

    def flops_s(self, flops: float, gpus: int, mfu: float) -> float:
        return flops / (gpus * self.node.peak_tflops * 1e12 * mfu)

    def prefill_s(self, tokens: int, gpus: int) -> float:
        return self.flops_s(2.0 * self.target.active * tokens, gpus, self.node.mfu.prefill)

    def decode(self, tokens: int, in_flight: int, context: float, gpus: int) -> tuple[float, str]:
        """(seconds, which bound) to generate `tokens` with `in_flight` requests of mean `context` tokens."""
        compute = self.flops_s(2.0 * self.target.active * in_flight, gpus, self.node.mfu.decode)
        size = self.target.size
        kv = in_flight * context * size.kv_bytes_per_token / (gpus if size.kv_split_by_tp else 1)
        memory = (size.weight_bytes / gpus + kv) / (self.node.hbm_tbps * 1e12)
        step, bound = (memory, "HBM-bound") if memory >= compute else (compute, "FLOP-bound")
        return tokens / in_flight * step, f"{bound}: {step * 1000:.1f} ms a step (FLOP {compute * 1000:.1f}, HBM {memory * 1000:.1f})"

    def loads_s(self, starts: int) -> float:
        return starts * self.node.model_load_min * 60.0
