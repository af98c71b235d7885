"""The memory plan: per-GPU memory of every GPU stage, before anything starts (`eagle3 plan`), with the hours of
each stage a retrain runs (eagle3/plan_time.py).

Stages: the regeneration server, hidden-state capture, training and serving. Target weights come from
the target's safetensors files (exact) or its config.json (estimated: architecture, dtype,
quantization); the training step is measured by running the trainer's own step on storage-less tensors
(eagle3/train/memory.py); the rest is counted from the config. A config whose stage does not fit
`node.gpu_memory_gib` is refused before any work, naming the stage and the knob to turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel

from eagle3.algorithms import DraftAlgorithm, algorithm
from eagle3.config import PipelineConfig
from eagle3.config.data import DataSection
from eagle3.config.draft import DraftSection
from eagle3.config.node import NodeSection
from eagle3.config.run import TargetSection
from eagle3.config.serving import ServingSection
from eagle3.config.training import TrainingSection
from eagle3.resolve import derived
from eagle3.data.regenerate import greedy_length
from eagle3.data.shards import TOKEN_BYTES
from eagle3.data.suites import planned_requests
from eagle3.data.storage import DTYPE_NAMES, human_bytes, projected_bytes
from eagle3.errors import ConfigError, UnreadableInput
from eagle3.target.info import DTYPE_BYTES, KV_CACHE_BYTES, TargetSize, read_target_size
from eagle3.plan_stream import choose_capture_nodes
from eagle3.plan_time import Scenario, TimePlan, plan_time
from eagle3.serving import serving_engine
from eagle3.train.memory import trainable_parameters, training_step_peak_by_op, training_step_peak_bytes

GIB = 2**30
RUNTIME_RESERVE_GIB = 5.0  # CUDA context, NCCL buffers, allocator fragmentation, SGLang's CUDA graphs


@dataclass
class StagePlan:
    name: str
    gpus: int  # GPUs the stage spreads over (tensor parallel or data parallel)
    parts: dict[str, float] = field(default_factory=dict)  # GiB per GPU by component
    knob: str = ""  # what to turn when it does not fit
    unknown: str | None = None  # why it could not be sized
    step_by_op: dict[str, float] = field(default_factory=dict)  # train: the measured step's GiB by the op that made it

    @property
    def per_gpu_gib(self) -> float | None:
        return None if self.unknown else round(sum(self.parts.values()), 2)


@dataclass
class MemoryPlan:
    gpu_memory_gib: float
    stages: list[StagePlan]
    target: TargetSize | None
    target_note: str
    storage: dict[str, int]  # bytes on disk, upper bounds (every sample at data.max_length)
    features: str  # training.features: online (the target on the training GPUs), offline or streamed
    time: TimePlan  # a first run's hours
    retrain: TimePlan  # a retrain's: the sample store's replies and a warm start
    recompute: str  # training.recompute as decided, and why
    streamed_instead: list[str] = field(default_factory=list)  # features online on several nodes: streamed's hours

    def fits(self, stage: StagePlan) -> bool | None:
        return None if stage.per_gpu_gib is None else stage.per_gpu_gib <= self.gpu_memory_gib

    @property
    def all_fit(self) -> bool:
        return all(self.fits(stage) is not False for stage in self.stages)

    def refusals(self) -> list[str]:
        return [f"{stage.name} needs {stage.per_gpu_gib:.1f} GiB per GPU, over node.gpu_memory_gib "
                f"{self.gpu_memory_gib:g}: {stage.knob}" for stage in self.stages if self.fits(stage) is False]

    def to_dict(self) -> dict:
        return {
            "gpu_memory_gib": self.gpu_memory_gib,
            "fits": self.all_fit,
            "target": {"weights_gib": _gib(self.target.weight_bytes) if self.target else None, "note": self.target_note},
            "training_features": self.features,
            "recompute": self.recompute,
            "storage_bytes": self.storage,
            "stages": [{"name": s.name, "per_gpu_gib": s.per_gpu_gib, "fits": self.fits(s), "gpus": s.gpus,
                        "parts": s.parts, "knob": s.knob, "unknown": s.unknown,
                        **({"step_by_op_gib": s.step_by_op} if s.step_by_op else {})} for s in self.stages],
            "hours": self.time.to_dict(),
            "retrain_hours": self.retrain.to_dict(),
        }

    def table(self) -> list[str]:
        lines = [f"target: {self.target_note}", f"GPU memory: {self.gpu_memory_gib:g} GiB (node.gpu_memory_gib)",
                 f"training features: {self.features}", self.recompute,
                 "disk, at most: " + ", ".join(f"{name.replace('_', ' ')} {human_bytes(n)}" for name, n in self.storage.items())]
        for stage in self.stages:
            if stage.unknown:
                lines.append(f"{stage.name:<11} unknown: {stage.unknown}")
                continue
            verdict = "fits" if self.fits(stage) else f"DOES NOT FIT: {stage.knob}"
            lines.append(f"{stage.name:<11} {stage.per_gpu_gib:8.1f} GiB per GPU on {stage.gpus} GPU(s)  {verdict}")
            width = max(len(name) for name in stage.parts)
            lines += [f"    {name:<{width}} {gib:8.2f}" for name, gib in stage.parts.items()]
        return lines + self.time.table() + self.retrain.table(assumptions=False) + self.streamed_instead


def _gib(n: float) -> float:
    return round(n / GIB, 2)


def target_size(target: TargetSection) -> tuple[TargetSize | None, str]:
    """The target's size from its directory, else from target.config_file; (None, why) when neither is here."""
    path = Path(target.path)
    source = path if (path / "config.json").is_file() else target.config_file
    if source is None:
        return None, (f"{path} is not a local model directory and target.config_file is not set: "
                      "the stages that hold the target cannot be sized")
    try:
        size = read_target_size(Path(source))
    except UnreadableInput as err:
        return None, str(err)
    return size, f"{_gib(size.weight_bytes)} GiB of weights ({size.weights_from})"


def plan_memory(config: PipelineConfig, nodes: int | None = None, capture_nodes: int | None = None) -> MemoryPlan:
    """`nodes`: the nodes the hours are planned for (planned_nodes by default); `capture_nodes`: of them, a streamed
    run's capture nodes (training.stream.capture_hosts' count on the config's own nodes, else the plan's choice)."""
    size, note = target_size(config.target)
    config, recompute = chosen_recompute(config)
    entry = algorithm(config.draft.algorithm)
    cfg = entry.draft_config(config.draft, config.target, config.vocab.draft_vocab_size, config.data.aux_layers)
    train = training_stage(entry, cfg, config.draft, config.training, config.data, config.target, config.node, size)
    stages = [regeneration_stage(config.data, config.serving, size),
              capture_stage(config.data, config.serving, config.target, size), train]
    streamed = config.training.features == "streamed"
    if capture_nodes is not None and not streamed:
        raise ConfigError(f"--capture-nodes plans training.features streamed; this config's is "
                          f"{config.training.features} (add --set training.features=streamed)")
    asked_by = "--capture-nodes"
    if nodes is None and streamed and config.training.stream.capture_hosts and capture_nodes is None:
        capture_nodes, asked_by = len(config.training.stream.capture_hosts), "training.stream.capture_hosts' count"
    nodes = nodes or planned_nodes(config.training, config.data)

    def split_of(planned, asked: int | None = None, asked_by: str = "--capture-nodes") -> tuple[int, str]:
        """A streamed config's capture nodes of `nodes`, and why, timed by its first run's train stage."""
        def train_hours(capture: int) -> float | None:
            timed = plan_time(planned, size, note, Scenario(retrain=False, nodes=nodes, capture_nodes=capture))
            return next(stage.hours for stage in timed.stages if stage.name == "train")

        return choose_capture_nodes(nodes, asked, asked_by, train_hours)

    split, why = split_of(config, capture_nodes, asked_by) if streamed else (0, "")
    if streamed:
        worker = capture_worker_stage(config.data, config.serving, config.training, config.target, size)
        stages.append(worker)
        if not split:  # the workers run on the trainers' GPUs
            shared_stage(train, worker)
    if config.serving is not None:  # a training-only config serves nothing
        stages.append(serving_stage(entry, cfg, config.draft, config.serving, config.node, size))
    heldout_tokens = (planned_requests(config.benchmark, config.heldout_set[0])
                      * (config.data.max_length + greedy_length(config)))
    storage = stored_bytes(config.data, config.target, config.training, heldout_tokens)
    times = [plan_time(config, size, note, Scenario(retrain, nodes, split)) for retrain in (False, True)]
    for hours in times if streamed else ():
        hours.notes.insert(0, why)
    instead = []  # features online keep training on one node of several: what streaming would take on them
    if nodes > 1 and config.training.features == "online" and config.data.feature_backend == "sglang":
        as_streamed = derived(config, {"training.features": "streamed"})
        capture, _ = split_of(as_streamed)
        first, again = (plan_time(as_streamed, size, note, Scenario(retrain, nodes, capture)).total_h
                        for retrain in (False, True))
        if None not in (first, again):
            instead.append(f"training stays on 1 node of {nodes} (features online); streamed, {capture} capturing "
                           f"and {nodes - capture} training: first run {first:.2f} h, retrain {again:.2f} h (--set "
                           f"training.features=streamed)")
    return MemoryPlan(config.node.gpu_memory_gib, stages, size, note, storage, config.training.features, *times,
                      recompute, instead)


def planned_nodes(training: TrainingSection, data: DataSection) -> int:
    """The nodes a config runs on: training's (and, streamed, its capture hosts), or the data stage's servers'
    (data.nodes) when more."""
    capture = len(training.stream.capture_hosts) if training.features == "streamed" else 0
    return max(training.nnodes + capture, len(data.nodes), 1)


def chosen_recompute(config: PipelineConfig) -> tuple[PipelineConfig, str]:
    """The config with training.recompute decided, and why: `auto` keeps every intermediate (the faster step) when
    the training stage fits node.gpu_memory_gib that way, else recomputes. The run's resolved config carries the
    choice to the trainers."""
    setting = config.training.recompute
    if setting != "auto":
        return config, f"training.recompute {setting}: set in the config"
    entry = algorithm(config.draft.algorithm)
    cfg = entry.draft_config(config.draft, config.target, config.vocab.draft_vocab_size, config.data.aux_layers)
    lean = training_stage(entry, cfg, config.draft, config.training.model_copy(update={"recompute": "none"}),
                          config.data, config.target, config.node, target_size(config.target)[0])
    budget = config.node.gpu_memory_gib
    if lean.per_gpu_gib is not None and lean.per_gpu_gib <= budget:
        choice, why = "none", f"the step fits without recomputing ({lean.per_gpu_gib:.1f} GiB per GPU of {budget:g})"
    elif lean.per_gpu_gib is None:
        choice, why = "norms_mlp", f"the training stage cannot be sized ({lean.unknown}): the smaller step is taken"
    else:
        choice, why = "norms_mlp", (f"without recomputing the step needs {lean.per_gpu_gib:.1f} GiB per GPU, over "
                                    f"node.gpu_memory_gib {budget:g}")
    return derived(config, {"training.recompute": choice}), f"training.recompute auto -> {choice}: {why}"


def stored_bytes(data: DataSection, target: TargetSection, training: TrainingSection,
                 heldout_tokens: int) -> dict[str, int]:
    """Upper bounds of what the data stage stores: hidden states (none online) and the features of the benchmark's
    requests (every suite's: `heldout_tokens`)."""
    hidden = 0 if training.tokens_only else data.num_samples * data.max_length
    return {"hidden_states": projected_bytes(data, target, hidden)[1],
            "tokens": data.num_samples * data.max_length * TOKEN_BYTES,
            "heldout_features": projected_bytes(data, target, heldout_tokens)[1]}


def target_parts(size: TargetSize, tp: int, tokens: int, pp: int = 1) -> dict[str, float]:
    """The target's weights and KV cache for `tokens` in flight, per GPU at tensor parallelism `tp` and `pp` pipeline
    stages (each holding its layers' weights and KV)."""
    kv = size.kv_bytes_per_token / (tp if size.kv_split_by_tp else 1) / pp
    return {f"target weights (/{tp * pp})": _gib(size.weight_bytes / (tp * pp)),
            f"KV cache, {tokens:,} tokens": _gib(tokens * kv)}


def regeneration_stage(data: DataSection, serving: ServingSection | None, size: TargetSize | None) -> StagePlan:
    served = data.generator != "local"  # by servers on serving.tp x serving.pp GPUs each
    tp, pp = (serving.tp, serving.pp) if served else (1, 1)
    in_flight, knob = (data.concurrency, "data.concurrency") if served else (data.batch_size, "data.batch_size")
    stage = StagePlan("regenerate", tp * pp, knob=f"lower {knob} ({in_flight} requests of up to {data.max_length} "
                      "tokens)")
    if size is None:
        stage.unknown = "target size unknown"
        return stage
    stage.parts = {**target_parts(size, tp, in_flight * data.max_length, pp), "runtime reserve": RUNTIME_RESERVE_GIB}
    return stage


def capture_stage(data: DataSection, serving: ServingSection | None, target: TargetSection,
                  size: TargetSize | None) -> StagePlan:
    """One capture batch: the target's forward with KV for the batch, and its features before they leave the GPU."""
    return target_forward_stage("capture", data.batch_size, f"lower data.batch_size ({data.batch_size} sequences per "
                                "forward)", data, serving, target, size)


def capture_worker_stage(data: DataSection, serving: ServingSection | None, training: TrainingSection,
                         target: TargetSection, size: TargetSize | None) -> StagePlan:
    """A streamed capture worker (one replica of the target, as serving holds it): the samples it claims at once."""
    batch = training.stream.capture_batch
    return target_forward_stage("capture worker", batch, f"lower training.stream.capture_batch ({batch} samples per "
                                "forward)", data, serving, target, size)


def target_forward_stage(name: str, sequences: int, knob: str, data: DataSection, serving: ServingSection | None,
                         target: TargetSection, size: TargetSize | None) -> StagePlan:
    """The target's forward over `sequences` of data.max_length tokens on one replica (serving.tp x serving.pp GPUs
    with SGLang's runner, 1 here): its weights, KV for them, and their features before they leave the GPU."""
    tp, pp = (serving.tp, serving.pp) if data.feature_backend == "sglang" else (1, 1)
    stage = StagePlan(name, tp * pp, knob=knob)
    if size is None:
        stage.unknown = "target size unknown"
        return stage
    tokens = sequences * data.max_length
    features = tokens * (len(data.aux_layers) + 1) * target.hidden_size * 2  # aux + last, bf16
    stage.parts = {**target_parts(size, tp, tokens, pp), "captured features (bf16)": _gib(features),
                   "runtime reserve": RUNTIME_RESERVE_GIB}
    return stage


def shared_stage(train: StagePlan, worker: StagePlan) -> None:
    """The train stage with a capture worker on its GPUs (streamed on one node): both hold their parts."""
    if worker.unknown or train.unknown:
        train.unknown = train.unknown or f"the capture worker on its GPUs cannot be sized ({worker.unknown})"
        return
    train.parts.update({f"capture worker on the same GPUs: {name}": gib for name, gib in worker.parts.items()
                        if name != "runtime reserve"})
    train.knob += "; or give the capture workers their own nodes (training.stream.capture_hosts)"


def training_stage(entry: DraftAlgorithm, cfg: BaseModel, draft: DraftSection, train: TrainingSection,
                   data: DataSection, target: TargetSection, node: NodeSection, size: TargetSize | None) -> StagePlan:
    """The step of `entry`'s draft of architecture `cfg` (its draft_config) on one forward's rows (a micro-batch: the
    global batch's size changes how many there are, not their memory); online, also the target on the same GPUs
    (tensor-parallel over the ranks, every rank holding the features of the whole global micro-batch before it keeps
    its rows)."""
    world = train.nproc_per_node * train.nnodes
    per_rank = train.sequences_per_forward(world)
    params = trainable_parameters(entry, cfg)
    shards = world if train.fsdp else 1
    embedding = target.vocab_size * target.hidden_size
    fewer = (f"lower training.micro_batch_size ({per_rank} sequences per GPU per forward now)" if train.micro_batch_size
             else f"set training.micro_batch_size under the {per_rank} sequences per GPU per forward now (each rank's "
             "share of training.batch_size)")
    stage = StagePlan("train", world, knob=(
        f"{fewer} or lower training.seq_len ({train.seq_len})"
        + ("" if train.fsdp or world == 1 else ", or set training.fsdp true")))
    recompute = train.recompute == "norms_mlp"  # chosen_recompute has decided `auto`
    predictions = entry.predictions(draft, train)
    shape = (entry, cfg, draft, per_rank, train.seq_len, predictions, data.last_hidden == "pre_norm",
             recompute)
    step = training_step_peak_bytes(*shape)
    stage.step_by_op = {op: _gib(n) for op, n in training_step_peak_by_op(*shape).items() if n >= GIB / 100}
    stage.parts = {
        f"draft weights, fp32 ({params / 1e9:.2f} B trainable)": _gib(4 * params),
        f"AdamW moments, fp32 (/{shards})": _gib(8 * params / shards),
        **{label: _gib(size) for label, size in entry.target_tensors(cfg).items()},
        "teacher head, bf16 (all rows + draft rows)": _gib(2 * embedding + 2 * cfg.draft_vocab_size * target.hidden_size),
        f"rows of one forward on the GPU ({per_rank} x {train.seq_len} tokens)": _gib(
            per_rank * train.seq_len * ((len(data.aux_layers) + 1) * target.hidden_size * 4 + 16)),
        f"training step, measured ({predictions} predictions a position: activations, teacher, gradients)": _gib(step),
        "runtime reserve": RUNTIME_RESERVE_GIB,
    }
    if train.fsdp and world > 1:  # FSDP2 keeps its own shard of the weights beside the gathered ones
        stage.parts[f"FSDP weight shards, fp32 (/{world})"] = _gib(4 * (params + embedding) / world)
    if train.features == "online":
        if size is None:
            stage.unknown = "online training holds the target, whose size is unknown"
            return stage
        stage.parts.update(online_target_parts(train, data, target, node, size, world))
        stage.knob += "; or training.features offline (the target leaves the training GPUs)"
    return stage


def online_target_parts(training: TrainingSection, data: DataSection, target: TargetSection, node: NodeSection,
                        size: TargetSize, world: int) -> dict[str, float]:
    """The target beside the trainer: its weights at TP = world, KV for one forward over the global micro-batch (every
    rank's rows of it), its features (bf16), and what SGLang's static pool (mem_fraction_static of the GPU) reserves
    beyond weights and KV. The target's forward activations are transient and come before the draft's step, whose
    measured peak is already counted."""
    tokens = world * training.sequences_per_forward(world) * training.seq_len
    parts = target_parts(size, world, tokens)
    features = tokens * (len(data.aux_layers) + 1) * target.hidden_size * 2
    parts[f"target features of the global micro-batch (bf16, {tokens:,} tokens)"] = _gib(features)
    fraction = data.sglang_engine_args.get("mem_fraction_static")
    if data.feature_backend == "sglang" and fraction is not None:
        reserved = float(fraction) * node.gpu_memory_gib - sum(parts.values())
        parts[f"SGLang pool beyond weights and KV (mem_fraction_static {fraction})"] = round(max(reserved, 0.0), 2)
    return parts


def serving_stage(entry: DraftAlgorithm, cfg: BaseModel, draft: DraftSection, serving: ServingSection,
                  node: NodeSection, size: TargetSize | None) -> StagePlan:
    """The target with `entry`'s draft of architecture `cfg` at serving.tp: one request of the full context must fit
    next to the weights."""
    stage = StagePlan("serve", serving.tp * serving.pp, knob=f"lower serving.context_length ({serving.context_length}) "
                      "or raise serving.tp")
    if size is None:
        stage.unknown = "target size unknown"
        return stage
    draft_kv = entry.kv_cache_entries(cfg, serving.tp) * KV_CACHE_BYTES
    stage.parts = {
        **target_parts(size, serving.tp, serving.context_length, serving.pp),
        f"draft weights, {DTYPE_NAMES[draft.torch_dtype]} (/{serving.tp})": _gib(
            DTYPE_BYTES[draft.torch_dtype] * trainable_parameters(entry, cfg) / serving.tp),
        "draft KV cache": _gib(serving.context_length * draft_kv),
        "runtime reserve": RUNTIME_RESERVE_GIB,
        **serving_engine(serving.engine).memory_left_unused(serving, node.gpu_memory_gib),
    }
    return stage


def require_fit(config: PipelineConfig, source: str | Path) -> MemoryPlan:
    """The plan, or a one-line ConfigError naming the first stage that does not fit and its knob."""
    plan = plan_memory(config)
    refusals = plan.refusals()
    if refusals:
        raise ConfigError(f"{source}: {refusals[0]} (eagle3 plan {source} shows every stage)")
    return plan

