"""The time plan: hours of each stage of a first run and of a retrain, on one node or several, and whether a retrain
fits node.retrain_period_h.

A first run generates every reply and trains training.max_steps from scratch. A retrain takes from the sample store
(eagle3/registry/samples.py) every reply an earlier run made under the same context, so it generates only the new
traffic prompts' (data.traffic), and warm-starts from production's draft for training.warm_steps (auto: the measured
WARM_STEP_RATIO of max_steps, plus the evaluations patience waits). On N nodes the regeneration runs on every node's
servers (data.nodes) and training spans the nodes (torchrun's c10d rendezvous) unless SGLang's runner computes the
features online, which needs one node's world; the servers the benchmark and sweep start run on serving.nodes at once
(eagle3/plan_serving.py), on serving.host alone without them. Streamed
(training.features streamed), capture workers prefill on K of the nodes (whole replicas of serving.tp x serving.pp GPUs)
and the trainers step on the other N - K, pipelined through the store: the train stage takes the slower of the two.

FLOPs come from the shapes: 2 x active parameters per token forward (a MoE target counts only the experts a token is
routed to; the input embedding is a lookup), 6 x the draft's trainable parameters per token per draft pass to train.
Time is FLOPs / (GPUs x node.peak_tflops x node.mfu.<kind>). Decode is bounded by memory too: each step reads every
weight and the KV cache in flight at node.hbm_tbps; the slower bound counts. Attention over the context, the teacher
head, tokenisation and I/O are not counted; every reply is taken at its max_new_tokens (an upper bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from eagle3.algorithms import algorithm
from eagle3.config import PipelineConfig
from eagle3.config.data import DataSection
from eagle3.config.deployment import RegistrySection
from eagle3.config.draft import DraftSection
from eagle3.config.run import TargetSection
from eagle3.config.serving import ServingSection
from eagle3.config.training import TrainingSection
from eagle3.resolve import contender_configs
from eagle3.data.regenerate import greedy_length, simulated_shapes
from eagle3.data.suites import planned_requests
from eagle3.plan_clock import Clock, Scenario, StageTime, Target, as_hours, unknown_stage
from eagle3.plan_serving import Measuring, serving_lanes
from eagle3.plan_stream import stream_flow, streamed_parts
from eagle3.target.info import TargetSize, active_parameters, read_target_config
from eagle3.train.memory import trainable_parameters

# The steps a warm start on shifted traffic needs to come within 1 % of a from-scratch draft's held-out accept length,
# as a share of training.max_steps: 0.33 on the tiny target and on SmolLM2 (benchmarks/warm_start_steps.py;
# docs/production-loop.md, "What a retrain reuses").
WARM_STEP_RATIO = 0.33


@dataclass
class TimePlan:
    scenario: Scenario
    assumptions: list[str]  # every figure the hours rest on, with the field it comes from
    figures: dict[str, float | int | None]  # the same figures by source field, for --json
    stages: list[StageTime]
    period_h: float
    reused: list[str] = field(default_factory=list)  # what a retrain takes instead of making it again
    ceiling_h: float | None = None  # a retrain whose warm start (warm_steps auto) still gains at max_steps
    stream: dict = field(default_factory=dict)  # streamed: the store's bytes and the network, for --json
    notes: list[str] = field(default_factory=list)  # streamed: the same in words
    servers: list[str] = field(default_factory=list)  # what serving.nodes would save (Measuring.spreading_note)

    @property
    def total_h(self) -> float | None:
        hours = [stage.hours for stage in self.stages]
        return None if None in hours else round(sum(hours), 2)

    @property
    def fits_period(self) -> bool | None:
        return None if self.total_h is None else self.total_h <= self.period_h

    def to_dict(self) -> dict:
        streamed = ({"capture_nodes": self.scenario.capture_nodes, "stream": self.stream, "stream_notes": self.notes}
                    if self.stream else {})
        return {"retrain": self.scenario.retrain, "nodes": self.scenario.nodes, **streamed,
                **({"server_notes": self.servers} if self.servers else {}),
                "assumptions": self.assumptions,
                "figures": self.figures, "reused": self.reused, "total_h": self.total_h, "ceiling_h": self.ceiling_h,
                "retrain_period_h": self.period_h, "fits_period": self.fits_period,
                "stages": [{"name": s.name, "hours": s.hours, "parts": s.parts, "unknown": s.unknown} for s in self.stages]}

    def table(self, assumptions: bool = True) -> list[str]:
        lines = [f"hours of {self.scenario.describe()}, by stage (estimates from FLOPs and HBM bandwidth; every prompt "
                 "and reply at its cap, so token counts are upper bounds):"]
        lines += [f"  assumed: {line}" for line in self.assumptions] if assumptions else []
        lines += [f"  reused: {line}" for line in self.reused]
        lines += [f"  stream: {line}" for line in self.notes]
        lines += [f"  servers: {line}" for line in self.servers]
        for stage in self.stages:
            if stage.unknown:
                lines.append(f"{stage.name:<11} unknown: {stage.unknown}")
                continue
            lines.append(f"{stage.name:<11} {stage.hours:8.2f} h")
            lines += [f"    {name}: {hours:.2f} h" for name, hours in stage.parts.items()]
        name = "retrain" if self.scenario.retrain else "first run"
        if self.total_h is None:
            return lines + [f"{name}: unknown"]
        verdict = ""
        if self.scenario.retrain:
            verdict = f"  {'fits' if self.fits_period else 'DOES NOT FIT'} node.retrain_period_h {self.period_h:g} h"
        lines.append(f"{name:<11} {self.total_h:8.2f} h{verdict}")
        if self.ceiling_h is not None:
            lines.append(f"            at most {self.ceiling_h:.2f} h: a warm start still gaining at training.max_steps")
        return lines


@dataclass(frozen=True)
class Heldout:
    """The benchmark's requests the data stage continues greedily (eagle3.data.suites.planned_requests) and the
    tokens each continuation runs (eagle3.data.regenerate.greedy_length)."""

    requests: int
    greedy: int

    def tokens(self, data: DataSection) -> int:
        """The held-out sequences' tokens, every prompt at data.max_length."""
        return self.requests * (data.max_length + self.greedy)


def plan_time(config: PipelineConfig, size: TargetSize | None, size_note: str,
              scenario: Scenario = Scenario(retrain=False)) -> TimePlan:
    target, size_note = read_target(config.target, size, size_note)
    node = config.node
    params, passes = draft_training(config.draft, config.target, config.vocab.draft_vocab_size, config.data.aux_layers,
                                    config.training)
    assumptions = [f"{node.peak_tflops:g} TFLOP/s per GPU (node.peak_tflops)", f"{node.hbm_tbps:g} TB/s (node.hbm_tbps)",
                   f"MFU decode {node.mfu.decode:g}, prefill {node.mfu.prefill:g}, train {node.mfu.train:g} "
                   "(node.mfu.decode / prefill / train)",
                   f"{node.model_load_min:g} min per server start (node.model_load_min)",
                   f"draft: {params / 1e6:,.0f} M trainable parameters, 6 x that x {passes[1]} FLOPs per training token"]
    if target is None:
        assumptions.append(f"target: {size_note}")
    else:
        assumptions.append(f"target: {target.active / 1e9:.1f} B active of {target.total / 1e9:.0f} B parameters per "
                           f"token ({target.source}); a decode step reads all {target.size.weight_bytes / 2**30:.0f} GiB "
                           "of weights (every expert: an upper bound when few requests are in flight)")
    figures = {"node.peak_tflops": node.peak_tflops, "node.hbm_tbps": node.hbm_tbps, "node.mfu.decode": node.mfu.decode,
               "node.mfu.prefill": node.mfu.prefill, "node.mfu.train": node.mfu.train,
               "node.model_load_min": node.model_load_min, "draft trainable parameters": params,
               "target active parameters": target and target.active, "target parameters": target and target.total}
    clock = Clock(node, target)
    heldout = Heldout(planned_requests(config.benchmark, config.heldout_set[0]), greedy_length(config))
    stages = [regenerate_time(config.data, config.serving, config.registry, clock, scenario, heldout),
              capture_time(config.data, config.serving, config.training, clock, heldout),
              train_time(config.training, config.data, config.serving, clock, params, passes[0], scenario)]
    measuring = None
    if config.serving is not None and config.benchmark is not None:
        measuring = Measuring(config.benchmark, config.serving, config.data, config.registry, config.sweep,
                              len(simulated_shapes(config.replay_shape, config.sweep)))
        stages += measuring.stages(clock, scenario, serving_lanes(config.serving, scenario.nodes))
    for name, contender in contender_configs(config).items():
        stages += contender_stages(name, contender, clock, scenario)
    if config.serving is not None and config.benchmark is not None:
        if config.production.mode == "managed":
            stages.append(StageTime("deploy", {"production restarted with the promoted draft: 1 server start":
                                               as_hours(clock.loads_s(1))}))
    reused = [generated_samples(config.data, config.registry, scenario)[1]] if scenario.retrain else []
    plan = TimePlan(scenario, assumptions, figures, stages, node.retrain_period_h, reused)
    if scenario.retrain and config.training.warm_steps == "auto" and plan.total_h is not None:
        full = train_time(config.training, config.data, config.serving, clock, params, passes[0],
                          replace(scenario, retrain=False))
        warm = next(stage for stage in stages if stage.name == "train")
        plan.ceiling_h = round(plan.total_h - warm.hours + full.hours, 2)
    if config.training.features == "streamed":
        plan.stream, plan.notes = stream_flow(config.data, config.target, config.training,
                                              (scenario.nodes, scenario.capture_nodes),
                                              streamed_rate(config.training, config.data, clock, scenario, stages))
    plan.servers = measuring.spreading_note(clock, scenario, stages) if measuring else []
    return plan


def streamed_rate(train: TrainingSection, data: DataSection, clock: Clock, scenario: Scenario,
                  stages: list[StageTime]) -> tuple[int, float] | None:
    """(tokens the capture workers put through the store, the hours they take: the train stage's less its start), or
    None where the workers share the trainers' node or the hours are unknown."""
    train_stage = next(stage for stage in stages if stage.name == "train")
    if train_stage.hours is None or not scenario.capture_nodes:
        return None
    _, _, trained, _, evaluated = trained_tokens(train, data, scenario)
    return trained + evaluated, train_stage.hours - as_hours(clock.loads_s(1))


def generated_samples(data: DataSection, registry: RegistrySection | None, scenario: Scenario) -> tuple[int, str]:
    """The training replies the run generates, and (for a retrain) why: the sample store holds the earlier runs'
    replies under an unchanged target and settings, so a retrain generates only its new traffic prompts'."""
    if not scenario.retrain:
        return data.num_samples, ""
    if not data.share_samples or registry is None:
        return data.num_samples, "nothing: no sample store (data.share_samples off, or no registry section)"
    traffic = data.traffic
    if traffic is None:
        return 0, (f"all {data.num_samples:,} replies from the sample store: without data.traffic a retrain's prompts "
                   "are the first run's")
    new = min(round(traffic.share * data.num_samples), int(traffic.max_prompts * (1 - data.heldout_fraction)))
    return new, (f"{data.num_samples - new:,} of data.num_samples {data.num_samples:,} replies from the sample store; "
                 f"{new:,} new traffic prompts answered (data.traffic.share {traffic.share:g}, at most max_prompts "
                 f"{traffic.max_prompts:,} less the held-out)")


def trained_steps(train: TrainingSection, scenario: Scenario) -> tuple[int, str]:
    """The optimizer steps a run trains, and the field that says so."""
    if not scenario.retrain or train.warm_steps is None:
        return train.max_steps, f"training.max_steps {train.max_steps:,}"
    if train.warm_steps != "auto":
        return train.warm_steps, f"training.warm_steps {train.warm_steps:,}"
    steps = min(train.max_steps, math.ceil(WARM_STEP_RATIO * train.max_steps) + train.patience * train.eval_every)
    return steps, (f"training.warm_steps auto: {steps:,} = {WARM_STEP_RATIO:g} (measured on small targets, "
                   f"extrapolated) x max_steps {train.max_steps:,} + patience {train.patience} x eval_every "
                   f"{train.eval_every}")


def training_nodes(training: TrainingSection, data: DataSection, scenario: Scenario) -> tuple[int, str]:
    """The nodes training spans: all of them, unless SGLang's runner computes the features online (its tensor-parallel
    group is the whole torch world: one node), or streamed capture workers take some."""
    if scenario.capture_nodes:
        trainers = scenario.nodes - scenario.capture_nodes
        return trainers, f"on {trainers} node(s) beside {scenario.capture_nodes} capture node(s)"
    if training.features == "online" and data.feature_backend == "sglang" and scenario.nodes > 1:
        return 1, "on 1 node: features online through SGLang's runner span one node's world"
    return scenario.nodes, f"on {scenario.nodes} node(s)"


def draft_training(draft: DraftSection, target: TargetSection, draft_vocab_size: int, aux_layers: list[int],
                   training: TrainingSection) -> tuple[int, tuple[float, str]]:
    """The draft's trainable parameters (its draft_config's, from these sections), and the positions its layers run
    per training token (and how the config says so)."""
    entry = algorithm(draft.algorithm)
    cfg = entry.draft_config(draft, target, draft_vocab_size, aux_layers)
    return trainable_parameters(entry, cfg), entry.draft_passes(draft, training)


def contender_stages(name: str, config: PipelineConfig, clock: Clock, scenario: Scenario) -> list[StageTime]:
    """A contender's training, measurement and sweep, on the run's data and beside the run's no-draft servers."""
    params, passes = draft_training(config.draft, config.target, config.vocab.draft_vocab_size, config.data.aux_layers,
                                    config.training)
    stages = [replace(train_time(config.training, config.data, config.serving, clock, params, passes[0], scenario),
                      name=f"train {name}")]
    if config.serving is not None and config.benchmark is not None:
        measuring = Measuring(config.benchmark, config.serving, config.data, config.registry, config.sweep,
                              len(simulated_shapes(config.replay_shape, config.sweep)))
        serve, sweep = measuring.stages(clock, scenario, serving_lanes(config.serving, scenario.nodes), False)
        stages += [replace(serve, name=f"serve {name}"), replace(sweep, name=f"sweep {name}")]
    return stages


def read_target(target: TargetSection, size: TargetSize | None, note: str) -> tuple[Target | None, str]:
    """The target's parameter counts from the config.json its size came from, or None and why not. A config.json
    without a field they need leaves the hours unknown, never the config refused (the memory plan runs at load)."""
    if size is None:
        return None, note
    path = Path(target.path)
    source = path if (path / "config.json").is_file() else Path(target.config_file)
    config_path, _, text = read_target_config(source)
    try:
        active, total = active_parameters(text)
    except (KeyError, ValueError, TypeError) as err:
        return None, f"{config_path}: cannot count its parameters per token ({type(err).__name__}: {err})"
    return Target(active, total, size, config_path), note


def draft_train_flops(params: int, passes: float, tokens: int) -> float:
    """6 x trainable parameters per token per draft pass (forward and backward: EAGLE-3's steps, a block draft's
    block positions per token); the step's measured MFU (benchmarks/train_throughput.py) counts the same, so it can replace
    node.mfu.train as it is."""
    return 6.0 * params * passes * tokens


def target_gpus(serving: ServingSection | None, engine: str) -> int:
    """The GPUs of one replica of the target: serving.tp x serving.pp for an engine, 1 for the local one."""
    return serving.tp * serving.pp if engine != "local" and serving is not None else 1


def regenerate_time(data: DataSection, serving: ServingSection | None, registry: RegistrySection | None, clock: Clock,
                    scenario: Scenario, heldout: Heldout) -> StageTime:
    """The answers the run generates at data.max_new_tokens, then the held-out prompts' greedy continuations; served,
    spread over the nodes' servers (data.nodes), each with data.concurrency in flight."""
    if clock.target is None:
        return unknown_stage("regenerate")
    if data.import_path is not None:
        return StageTime("regenerate", {"data.import_path: nothing generated": 0.0})
    gpus, served = target_gpus(serving, data.generator), data.generator != "local"
    in_flight, field_name = (data.concurrency, "data.concurrency") if served else (data.batch_size, "data.batch_size")
    nodes = scenario.nodes if served else 1
    samples, _ = generated_samples(data, registry, scenario)
    prompt = max(data.max_length - data.max_new_tokens, 0)
    tokens = samples * data.max_new_tokens + heldout.requests * heldout.greedy
    decode_s, bound = clock.decode(tokens / nodes, in_flight, prompt + data.max_new_tokens / 2, gpus)
    where = f"on {nodes} node(s), {in_flight} in flight on each ({field_name}{' per server' if nodes > 1 else ''})"
    starts = f"1 server start{' on each node, at once' if nodes > 1 else ''}"
    return StageTime("regenerate", {
        f"{starts}{' (data.servers, started outside the pipeline)' if served and nodes == 1 and not data.nodes else ''}":
            as_hours(clock.loads_s(1)),
        f"prompts: {samples:,} generated x {prompt:,} tokens (data.max_length - max_new_tokens), prefill on {gpus} "
        f"GPU(s) {where}": as_hours(clock.prefill_s(samples * prompt / nodes, gpus)),
        f"decode: {samples:,} x data.max_new_tokens {data.max_new_tokens:,} + {heldout.requests} benchmark requests x "
        f"{heldout.greedy} "
        f"tokens, {where}, {bound}": as_hours(decode_s)})


def capture_time(data: DataSection, serving: ServingSection | None, training: TrainingSection, clock: Clock,
                 heldout: Heldout) -> StageTime:
    """The target's forward over what is captured: the held-out sequences, and offline every sample."""
    if clock.target is None:
        return unknown_stage("capture")
    gpus = target_gpus(serving, data.feature_backend)
    sequences = heldout.tokens(data)
    samples = 0 if training.tokens_only else data.num_samples * data.max_length
    what = (f"held-out sequences only (training.features {training.features})" if not samples else
            f"data.num_samples {data.num_samples:,} x data.max_length {data.max_length:,} + the held-out sequences")
    return StageTime("capture", {"1 engine start": as_hours(clock.loads_s(1)),
                                 f"prefill: {what}, {samples + sequences:,} tokens on {gpus} GPU(s)":
                                 as_hours(clock.prefill_s(samples + sequences, gpus))})


def trained_tokens(train: TrainingSection, data: DataSection, scenario: Scenario) -> tuple[int, str, int, int, int]:
    """(optimizer steps, the field saying so, tokens trained, evaluations, tokens evaluated)."""
    steps, steps_from = trained_steps(train, scenario)
    evaluations = steps // train.eval_every
    return (steps, steps_from, steps * train.batch_size * train.seq_len, evaluations,
            evaluations * int(data.num_samples * train.eval_fraction) * train.seq_len)


def train_time(train: TrainingSection, data: DataSection, serving: ServingSection | None, clock: Clock, params: int,
               passes: float, scenario: Scenario) -> StageTime:
    """The draft's steps and evaluations; online, the target's forward over every sequence on the same GPUs;
    streamed, the capture workers' forward over them beside the trainers."""
    node = clock.node
    steps, steps_from, tokens, evaluations, eval_tokens = trained_tokens(train, data, scenario)
    nodes, where = training_nodes(train, data, scenario)
    world = train.nproc_per_node * nodes
    parts = {f"draft: {steps_from} x batch_size {train.batch_size} x seq_len {train.seq_len:,} = {tokens / 1e9:.2f} B "
             f"tokens on {world} GPU(s), {where}": as_hours(clock.flops_s(draft_train_flops(params, passes, tokens), world,
                                                                   node.mfu.train)),
             f"evaluation: {evaluations} x {eval_tokens // max(evaluations, 1):,} tokens (training.eval_every, "
             "eval_fraction), forward only": as_hours(clock.flops_s(2.0 * params * passes * eval_tokens, world,
                                                                node.mfu.train))}
    if train.features == "online":
        if clock.target is None:
            return unknown_stage("train")
        parts["target's features online: 1 engine start"] = as_hours(clock.loads_s(1))
        parts[f"target's features online: prefill of the {(tokens + eval_tokens) / 1e9:.2f} B tokens"] = as_hours(
            clock.prefill_s(tokens + eval_tokens, world))
    if train.features == "streamed":
        if clock.target is None:
            return unknown_stage("train")
        captured = tokens + eval_tokens
        streamed = streamed_parts(parts, captured, target_gpus(serving, "sglang"), train.nproc_per_node,
                                  scenario.capture_nodes, lambda gpus: as_hours(clock.prefill_s(captured, gpus)),
                                  as_hours(clock.loads_s(1)))
        return StageTime("train", unknown=streamed) if isinstance(streamed, str) else StageTime("train", streamed)
    return StageTime("train", parts)
