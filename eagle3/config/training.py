"""The trainer's section (`training`): the objective, the schedule, and how the ranks are launched."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from eagle3.config.base import Section, SshArgs
from eagle3.config.stream import StreamSection
from eagle3.procs import STOP_GRACE_S


class TrainingSection(Section):
    recompute: Literal["auto", "none", "norms_mlp"] = Field(
        default="auto", description="norms_mlp: the backward recomputes the norms and the SwiGLU product instead of "
        "keeping their float32 intermediates (less memory, a slower step); auto: only when the step would not fit "
        "node.gpu_memory_gib without it (`eagle3 plan` says which and why; the results are the same either way)")
    features: Literal["online", "offline", "streamed"] = Field(
        default="offline", description="online: the trainer computes the target's features batch by batch and "
        "nothing is stored; offline: they are captured to data/hidden first and read back; streamed: capture workers "
        "outside the training world compute them and the trainers take them from a Mooncake store (training.stream, "
        "docs/streamed-features.md)")
    stream: StreamSection = Field(default=StreamSection(), description="training.features streamed: the store, its "
                                  "watermarks and the capture workers")
    ttt_steps: int = Field(default=7, ge=1)
    ttt_step_decay: float = Field(default=0.8, gt=0.0, le=1.0)
    learning_rate: float = Field(gt=0.0)
    warmup_steps: int = Field(default=0, ge=0)
    warmup_start: Literal["lr_over_warmup", "zero"] = Field(
        default="lr_over_warmup", description="lr_over_warmup: step 0 trains at learning_rate / warmup_steps and step "
        "warmup_steps - 1 at the peak; zero: step 0 at 0 and the peak at step warmup_steps")
    lr_floor: float = Field(default=0.1, ge=0.0, le=1.0, description="the cosine decay ends at this fraction of "
                            "learning_rate (at max_steps)")
    adam_betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW's (beta1, beta2)")
    weight_decay: float = Field(default=0.0, ge=0.0, description="AdamW's decoupled weight decay, on every trained "
                                "tensor (norms included)")
    freeze_head: bool = Field(default=False, description="keep the draft's lm_head at the target's rows for the draft "
                              "vocabulary and its final norm at the target's (an init_from draft's own when "
                              "fine-tuning): only the layer below learns, to make a hidden state the target's head reads")
    feature_noise: float = Field(default=0.0, ge=0.0, description="training steps add uniform noise U(-a, a) x the "
                                 "feature's RMS to each captured aux state (a per layer and position); never in "
                                 "evaluation, replay or serving. 0: off")
    loss_positions: Literal["generated", "all"] = Field(
        default="generated", description="what a training step scores against the target's distribution: "
        "generated - the target's reply tokens (what serving drafts); all - every real position, the prompt's too (the "
        "target's prediction there is a teacher all the same): more signal per sample, more rows for the teacher and "
        "the head. Evaluation scores the generated positions either way")
    teacher_temperature: float = Field(default=1.0, gt=0.0, description="the target's draft-vocabulary distribution "
                                       "the draft learns is softmax(logits / this): below 1 sharper, toward the "
                                       "argmax greedy acceptance checks")
    max_steps: int = Field(gt=0)
    warm_steps: int | Literal["auto"] | None = Field(
        default=None, description="the step budget of a warm start (training.init_from: a retrain from production's "
        "draft). None: training.max_steps; a number: that many steps; auto: stop once the best_by score has gained "
        "no more than training.min_gain for training.patience evaluations in a row, at training.max_steps at most "
        "(docs/training.md)")
    patience: int = Field(default=3, gt=0, description="warm_steps auto: evaluations in a row without a gain that "
                          "end a warm start")
    min_gain: float = Field(default=0.0, ge=0.0, description="warm_steps auto: what counts as a gain - the best_by "
                            "score beating the last gain's by more than this (in its units: accept length, accuracy "
                            "or loss); 0: any improvement")
    batch_size: int = Field(gt=0, description="global batch per optimizer step, in sequences (all ranks, micro-batches)")
    micro_batch_size: int | None = Field(
        default=None, gt=0, description="sequences one GPU's draft takes per forward (online: the target's forward "
        "takes ranks x this many): a step accumulates gradients over batch_size / (ranks x micro_batch_size) "
        "micro-batches, syncs them once, and makes the update one batch would. None: each rank's whole share at once")
    seq_len: int = Field(gt=1)
    grad_clip: float = Field(default=1.0, gt=0.0)
    nproc_per_node: int = Field(default=1, ge=1)
    nnodes: int = Field(default=1, ge=1)
    fsdp: bool = Field(default=False, description="shard weights, gradients and optimizer state (FSDP2) instead of DDP")
    eval_fraction: float = Field(default=0.05, ge=0.0, lt=1.0, description="share of samples kept out for evaluation")
    init_from: str | None = Field(
        default=None, min_length=1, description="fine-tune this draft: a version id of the registry (its sglang "
        "layout) or a draft directory in the native, sglang or speculators layout; the vocab map may differ, the "
        "architecture may not (docs/training.md)")
    eval_every: int = Field(default=100, gt=0)
    best_by: Literal["accept_length", "step_acc", "eval_loss"] = Field(
        default="accept_length", description="what makes train/best the best draft at an evaluation: accept_length - "
        "the accept length replayed over the held-out greedy sequences as the simulator does; step_acc - the eval "
        "split's per-step accuracy weighted ttt_step_decay**k; eval_loss - the eval split's loss (lowest wins). "
        "Evaluation replays only for accept_length")
    replay_prompts: int | None = Field(
        default=None, gt=0, description="held-out greedy sequences the accept_length replay drafts over (None: "
        "benchmark.num_prompts, every one). Without a benchmark section it is required: the data stage continues "
        "this many held-out prompts")
    replay_max_new_tokens: int | None = Field(
        default=None, gt=0, description="the replay's max_new_tokens (None: benchmark.max_new_tokens, as the "
        "simulator). Without a benchmark section it is required: the data stage's continuations are this long plus "
        "the drafting steps")
    save_every: int = Field(default=100, gt=0)
    keep_last: int = Field(default=2, ge=1)
    seed: int = 0
    launcher: Literal["local", "ssh", "srun"] = Field(
        default="local", description="how training starts: here, one ssh per host in training.hosts, or one srun step")
    hosts: list[str] = Field(default=[], description="launcher ssh: one host per node, each starting one torchrun")
    ssh_args: SshArgs = Field(
        default=[], description="launcher ssh: options before the host in every ssh it runs, e.g. [-p, '2222', -i, "
        "~/.ssh/cluster, -o, ProxyJump=login-1] (options only: the launcher adds -tt, the host and the command)")
    rdzv_endpoint: str | None = Field(
        default=None,
        description="several nodes: host:port of the c10d rendezvous, reachable from every node (e.g. the first host)")
    srun_args: list[str] = Field(
        default=[], description="launcher srun: arguments before the command, e.g. [--gres=gpu:8]; the launcher sets "
        "--nodes and --ntasks-per-node itself (one torchrun per node)")
    python: str = Field(default="python", description="the python on the nodes for launchers ssh and srun")
    stop_grace_s: float = Field(
        default=STOP_GRACE_S, gt=0.0, description="after SIGTERM the trainer finishes its step and saves a checkpoint; what is "
        "still alive after this is killed (keep it under Prefect's 30 s between a cancel's SIGTERM and SIGKILL)")

    @property
    def tokens_only(self) -> bool:
        """Whether the data set holds token rows only (online and streamed: the target's features are computed while
        training, never stored)."""
        return self.features != "offline"

    @property
    def busy_processes_here(self) -> int:
        """Busy processes on a training node, each given its share of the cores (eagle3.procs.cpu_threads): its
        ranks, and the streamed capture workers the train stage starts beside them (no capture_hosts, launcher
        local)."""
        stream = self.stream
        beside = self.features == "streamed" and not stream.capture_hosts and self.launcher == "local"
        return self.nproc_per_node + (stream.workers_per_host * (stream.replica_ranks or 1) if beside else 0)

    def sequences_per_forward(self, world: int) -> int:
        """Sequences one rank's draft takes per forward: micro_batch_size, else its whole share of batch_size."""
        return self.micro_batch_size or self.batch_size // world

    @field_validator("adam_betas")
    @classmethod
    def _betas(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= beta < 1.0 for beta in value):
            raise ValueError(f"{list(value)}: each beta must be in [0, 1), e.g. [0.9, 0.95]")
        return value

    @field_validator("rdzv_endpoint")
    @classmethod
    def _host_and_port(cls, value: str | None) -> str | None:
        host, _, port = (value or "").rpartition(":")
        if value is not None and not (host and port.isdigit()):
            raise ValueError(f"'{value}' is not host:port; write it like node-1:29500")
        return value

    def step_budget(self, warm: bool) -> int:
        """The steps a run trains at most: a warm start's warm_steps when it names a number, else max_steps."""
        return self.warm_steps if warm and isinstance(self.warm_steps, int) else self.max_steps

    def stops_on_patience(self, warm: bool) -> bool:
        return warm and self.warm_steps == "auto"

    @model_validator(mode="after")
    def _warm_steps_within_max_steps(self) -> TrainingSection:
        if isinstance(self.warm_steps, int) and not 0 < self.warm_steps <= self.max_steps:
            raise ValueError(f"training.warm_steps {self.warm_steps} must be in 1..training.max_steps "
                             f"({self.max_steps}), or auto: the learning-rate schedule spans max_steps")
        return self

    @model_validator(mode="after")
    def _launcher_reaches_every_node(self) -> TrainingSection:
        if self.nnodes > 1 and self.launcher == "local":
            raise ValueError(f"training.nnodes {self.nnodes} needs training.launcher ssh (with one training.hosts "
                             "entry per node) or srun; local starts one node")
        if self.launcher == "ssh" and len(self.hosts) != self.nnodes:
            raise ValueError(f"training.launcher ssh needs one training.hosts entry per node: {len(self.hosts)} "
                             f"hosts for training.nnodes {self.nnodes}")
        if self.launcher != "ssh" and (self.hosts or (self.ssh_args and not self.stream.capture_hosts)):
            field = "hosts" if self.hosts else "ssh_args"
            also = " (or training.stream.capture_hosts)" if field == "ssh_args" else ""
            raise ValueError(f"training.{field} is for training.launcher ssh, not {self.launcher}{also}; remove it")
        if self.stream.capture_hosts and self.features != "streamed":
            raise ValueError(f"training.stream.capture_hosts starts capture workers for training.features streamed, not "
                             f"{self.features}: set training.features streamed or remove them")
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError(f"training.nnodes {self.nnodes} needs training.rdzv_endpoint host:port, the rendezvous "
                             "every node's torchrun joins (e.g. the first node, port 29500)")
        problem = batch_split_problem(self.batch_size, self.micro_batch_size, self.nproc_per_node * self.nnodes,
                                      "training.nproc_per_node x nnodes")
        if problem:
            raise ValueError(problem)
        counts = sorted({option_name(a) for a in self.srun_args} & SRUN_COUNT_OPTIONS)
        if counts:
            raise ValueError(f"training.srun_args sets {', '.join(counts)}; the launcher sets the node and task "
                             "counts from training.nnodes (one torchrun per node): remove them")
        return self


SRUN_COUNT_OPTIONS = {"-N", "--nodes", "-n", "--ntasks", "--ntasks-per-node"}


def batch_split_problem(batch_size: int, micro_batch_size: int | None, world: int, world_from: str) -> str | None:
    """Why training.batch_size does not split into whole micro-batches on `world` ranks (None: it does). The config
    checks nproc_per_node x nnodes, the trainer the ranks it runs on (torchrun may start others)."""
    per_step = world * (micro_batch_size or 1)
    if batch_size % per_step == 0:
        return None
    micro = f" x training.micro_batch_size {micro_batch_size} = {per_step}" if micro_batch_size else ""
    near = max(per_step, round(batch_size / per_step) * per_step)
    return (f"training.batch_size {batch_size} must be a multiple of the {world} ranks ({world_from}){micro}: set "
            f"it to {near}" + (" or lower training.micro_batch_size" if (micro_batch_size or 1) > 1 else ""))


def option_name(arg: str) -> str:
    """The option an argument sets: `--nodes=2` -> --nodes, `-N2` -> -N (a short option's value may be attached)."""
    if arg.startswith("-") and not arg.startswith("--"):
        return arg[:2]
    return arg.split("=", 1)[0]
