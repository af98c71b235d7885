"""The time plan's clock (eagle3/plan_time.py): seconds of prefill, decode, training FLOPs and server starts on the
node's GPUs, from node.peak_tflops, node.hbm_tbps, node.mfu and node.model_load_min, and the target's shape; a
stage's hours by part, and the scenario they are planned for."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from eagle3.config.node import NodeSection
from eagle3.target.info import TargetSize

HOUR = 3600.0


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


@dataclass
class StageTime:
    name: str
    parts: dict[str, float] = field(default_factory=dict)  # hours by component, each name saying what it counts
    unknown: str | None = None
    servers: int = 0  # server starts the stage runs one after another, each on the whole node

    @property
    def hours(self) -> float | None:
        return None if self.unknown else round(sum(self.parts.values()), 2)


@dataclass(frozen=True)
class Scenario:
    retrain: bool  # a retrain: the sample store's replies and a warm start; else a first run from scratch
    nodes: int = 1
    capture_nodes: int = 0  # streamed: nodes running capture workers only (0: the workers share the trainers' node)

    def describe(self) -> str:
        kind = "a retrain (warm start from production)" if self.retrain else "a first run (from scratch)"
        split = (f" ({self.capture_nodes} capturing, {self.nodes - self.capture_nodes} training)"
                 if self.capture_nodes else "")
        return f"{kind} on {self.nodes} node(s){split}"


def as_hours(seconds: float) -> float:
    return round(seconds / HOUR, 3)


def unknown_stage(name: str) -> StageTime:
    return StageTime(name, unknown="the target's shape is unknown (the target line above says why)")
