"""The one table of the pipeline's cached stages. Each `Stage` names everything the rest of the project spells about
it: its output under run.dir, the config fields its key covers, the stages whose outputs it reads, what it resumes
from, the `eagle3` step that runs it by hand and the library call that does the work. The keys and markers
(eagle3.stages.keys), the Prefect tasks and the flow's order (tasks/stages.py, flows/eagle3.py), the CLI steps
(eagle3.cli.steps) and the config-field coverage test read it; a new stage is one entry here and its runner.

`OPERATIONAL` is the other half of the coverage: every config field is in some stage's key or listed there with the
reason it changes no stage's output (tests/test_stages.py holds the two lists against the config's fields).

The run's records that the uncached steps write (served, sweep, suites) are named in `RECORDS`, with the simulated
result the simulate stage writes, so each file name is spelled once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3.config import PipelineConfig


@dataclass(frozen=True)
class StageRun:
    """What a stage's runner is given: the config, the run's resolved config file (trainers and node commands read
    it), the log, and `progress(fraction done)` for a stage that can tell."""
    config: PipelineConfig
    resolved: Path
    log: Callable[[str], None]
    progress: Callable[[float], None] = lambda fraction: None


@dataclass(frozen=True)
class ByContent:
    """A key input computed from what config fields point at (a file's, a target's, a draft's content), in place of
    the fields' values. Reads local files only: a key never fetches, generates or writes."""
    fields: tuple[str, ...]
    value: Callable[[PipelineConfig], object]


@dataclass(frozen=True)
class Stage:
    name: str  # of its marker, Prefect task, `eagle3` step and report line
    output: str | Callable[[PipelineConfig], Path]  # what it makes, under run.dir (its marker sits beside it): a
    # path, or the library's function that names it
    key: tuple[str, ...]  # config sections or dotted fields whose values decide its output
    runner: Callable[[StageRun], None]
    command: tuple[str, ...]  # the `eagle3` step that runs it by hand
    help: str
    upstream: Mapping[str, str] = field(default_factory=dict)  # {the name its task takes an output by: that stage}:
    # every stage whose files under run.dir it reads - its key holds these outputs' fingerprints, not their keys, so a
    # stage further up counts only where one of them records its fingerprint (tests/test_stage_reads.py audits reads)
    by_content: Mapping[str, ByContent] = field(default_factory=dict)
    resumes: tuple[str | Callable[[PipelineConfig], Path], ...] = ()  # under run.dir, as `output`: what it resumes
    # from, cleared when its inputs changed
    refines: tuple[str, ...] = ()  # key inputs whose change keeps what it resumes from
    needs: tuple[str, ...] = ()  # config sections a training-only config may lack that it cannot run without
    per_draft: bool = False  # runs once for each draft a run trains (its own and each contender's, on the shared
    # data): its outputs are under the draft's run.dir, the shared stages' under run.data_dir

    def key_fields(self) -> tuple[str, ...]:
        return self.key + tuple(name for item in self.by_content.values() for name in item.fields)


def regenerated(config: PipelineConfig) -> Path:
    from eagle3.data.regenerate import regen_dir

    return regen_dir(config.run)


def suite_continuations(config: PipelineConfig) -> Path:
    from eagle3.data.continuations import suites_dir

    return suites_dir(config.run)


def suite_features(config: PipelineConfig) -> Path:
    from eagle3.data.suite_capture import suite_features_dir

    return suite_features_dir(config.run)


def vocab_map(config: PipelineConfig) -> Path:
    return config.stage_dir("vocab")


def dataset(config: PipelineConfig) -> Path:
    """The data set the trainer reads: feature shards, or token shards when training computes features online."""
    from eagle3.data.capture import dataset_dir

    return dataset_dir(config.run, config.training)


def trained(config: PipelineConfig) -> Path:
    from eagle3.train.trainer import best_draft

    return best_draft(config.run)


def served_export(config: PipelineConfig) -> Path:
    """The served layout's directory (sglang): what the export stage's marker sits beside."""
    from eagle3.export import export_dirs

    return export_dirs(config.run, config.export)["sglang"]


# ---- runners: the library call each stage makes (imported when it runs: `eagle3 --help` stays light)

def regenerate(run: StageRun) -> None:
    from eagle3.data.importer import make_samples
    from eagle3.registry.samples import open_sample_store
    from eagle3.serve.data_nodes import on_nodes

    c = run.config
    store = None if c.data.import_path else open_sample_store(c.registry, c.data, c.target, run.log)
    with on_nodes(run.config, run.log) as (config, generator):  # data.nodes: servers started for the stage
        make_samples(config, log=run.log, store=store, generator=generator)


def continue_suites(run: StageRun) -> None:
    from eagle3.data.continuations import continuations_kept
    from eagle3.data.continuations import continue_suites as make
    from eagle3.data.regenerate import continuing
    from eagle3.serve.data_nodes import on_nodes

    spec = continuing(run.config)
    if continuations_kept(spec):  # nothing to continue: no servers started
        make(spec, log=run.log)
        return
    with on_nodes(run.config, run.log) as (config, generator):  # data.nodes: servers started for the stage
        make(continuing(config), log=run.log, generator=generator)


def capture(run: StageRun) -> None:
    from eagle3.data.node_capture import capture_with_engine
    from eagle3.registry.samples import open_feature_store

    c = run.config
    store = open_feature_store(c.registry, c.data, c.target, c.training, run.log)
    capture_with_engine(c.run, c.data, c.target, c.training, c.serving, run.resolved, log=run.log, store=store)


def capture_suites(run: StageRun) -> None:
    from eagle3.data.node_capture import capture_suites_with_engine

    c = run.config
    capture_suites_with_engine(c.run, c.data, c.target, c.serving, run.resolved, log=run.log)


def vocab(run: StageRun) -> None:
    from eagle3.data.vocab import build_vocab

    c = run.config
    build_vocab(c.run, c.data, c.target, c.vocab, log=run.log)


def train(run: StageRun) -> None:
    from eagle3.init_draft import resolve_init_from
    from eagle3.train.launch import train as launch

    budget = run.config.training.step_budget(warm=run.config.training.init_from is not None)

    def on_metrics(record: dict) -> None:
        if "loss" in record:
            run.progress(record["step"] / budget)

    c = run.config
    # training.init_from fetched and converted once, for every rank
    resolve_init_from(c.run, c.training, c.draft, c.target, c.serving, c.registry, run.log)
    launch(c.run, c.data, c.training, c.serving, run.resolved, log=run.log, on_metrics=on_metrics)


def export(run: StageRun) -> None:
    from eagle3.export import export_draft

    c = run.config
    export_draft(c.run, c.draft, c.target, c.training, c.export, c.serving, log=run.log)


def simulate(run: StageRun) -> None:
    from eagle3.bench.simulate import replay_of
    from eagle3.bench.simulate import simulate as replay

    replay(replay_of(run.config), output_of(run.config, "export"), record_path(run.config, "simulated"), log=run.log)


# ---- key inputs read from content

def target_content(config: PipelineConfig) -> dict:
    from eagle3.runtime.targets import target_identity

    return target_identity(config.target)


def prompt_source(config: PipelineConfig) -> str:
    """A local prompt file by content; `builtin:` sources and s3:// URIs by name (an S3 object is read anew by a
    retrain, which runs in a fresh run directory)."""
    from eagle3.fsutil import sha256_file

    path = Path(config.data.prompts)
    return sha256_file(path) if path.is_file() else config.data.prompts


def imported_rows(config: PipelineConfig) -> str | None:
    from eagle3.fsutil import cached_sha256

    return None if config.data.import_path is None else cached_sha256(config.data.import_path)


def traffic_selection(config: PipelineConfig) -> dict | None:
    """What picks the traffic prompts: the data stage snapshots them once per run directory (and again when this
    changes), and every key holds the run directory's token."""
    traffic = config.data.traffic
    if traffic is None:
        return None
    return {**traffic.model_dump(mode="json"), "slice_label": config.production.telemetry.slice_label}


def heldout_set(config: PipelineConfig) -> list:
    """The held-out prompts' greedy continuations the regenerate stage makes (training replays them): how many (the
    benchmark's, or the held-out suite's own count) and how long (the benchmark's, or the replay's, past the deepest
    simulated shape). The other suites are the suites stage's."""
    from eagle3.config.suites import HELDOUT
    from eagle3.data.regenerate import greedy_length

    own = [suite.num_prompts for suite in (config.benchmark.suites if config.benchmark else ()) if suite.name == HELDOUT]
    return [config.heldout_set[0], greedy_length(config), own]


def suite_set(config: PipelineConfig) -> list:
    """The other suites' greedy continuations the suites stage makes: their questions by content (the traffic suite's
    count defaults to the benchmark's), the answers' length (a multi-turn question's later turns follow the target's
    answers) and the continuations'."""
    from eagle3.config.suites import TRAFFIC
    from eagle3.data.regenerate import greedy_length
    from eagle3.data.suites import other_suites, suites_key

    suites = other_suites(config.benchmark)
    traffic = config.heldout_set[0] if any(suite.name == TRAFFIC for suite in suites) else None
    return [suites_key(suites), traffic, config.heldout_set[1], greedy_length(config)] if suites else []


def init_draft_content(config: PipelineConfig) -> str | None:
    """The draft training starts from, by its content, never by its path or version id."""
    from eagle3.init_draft import init_draft

    draft = init_draft(config.training, config.draft, config.registry)
    return None if draft is None else draft.sha256


def counting_rules(config: PipelineConfig) -> str | None:
    """The release whose finish and counting rules the serving engine's counts follow: switching engines re-keys a
    replay only where the counting changes."""
    from eagle3.bench.simulate import counting_release

    return counting_release(config.serving)


TARGET = ByContent(("target",), target_content)  # its config and tokenizer files' content, dtype and shape
COUNTING = ByContent(("serving.engine",), counting_rules)
REPLAY = ("serving.release", "serving.num_steps", "serving.eagle_topk", "serving.num_draft_tokens",
          "benchmark.num_prompts", "benchmark.max_new_tokens")  # counted as the served release counts, in its shape

STAGES: dict[str, Stage] = {stage.name: stage for stage in (
    Stage("regenerate", regenerated, runner=regenerate, command=("data", "regenerate"),
          help="the target writes the assistant turns of the training prompts (or data.import_path's rows are "
          "imported), with the held-out prompts' greedy continuations",
          key=("data.generator", "data.num_samples", "data.max_new_tokens", "data.max_length", "data.temperature",
               "data.thinking", "data.heldout_fraction", "data.quality"),
          by_content={"target": TARGET, "prompt_source": ByContent(("data.prompts",), prompt_source),
                      "import_sha256": ByContent(("data.import_path",), imported_rows),
                      "traffic": ByContent(("data.traffic", "production.telemetry.slice_label"), traffic_selection),
                      "heldout": ByContent(("benchmark.num_prompts", "benchmark.max_new_tokens", "benchmark.suites",
                                            "training.replay_prompts", "training.replay_max_new_tokens",
                                            "serving.num_steps", "sweep.points"), heldout_set)},
          resumes=(regenerated,),
          # more or fewer samples of the same kind (only new ones are generated), other quality thresholds over the
          # same replies, or other held-out continuations (only the continuations are made again)
          refines=("data.num_samples", "data.quality", "heldout")),
    # its own output, so that a suite added to a finished run re-keys only the replays (simulate reads it, training
    # never)
    Stage("suites", suite_continuations, runner=continue_suites, command=("data", "regenerate"),
          help="then those of benchmark.suites' other suites",
          key=("data.generator", "data.thinking"),
          by_content={"target": TARGET,
                      "suites": ByContent(("benchmark.suites", "benchmark.num_prompts", "benchmark.max_new_tokens",
                                           "training.replay_max_new_tokens", "serving.num_steps", "sweep.points"),
                                          suite_set)},
          upstream={"regenerated": "regenerate"}),  # the held-out prompts file, its traffic suite's questions
    Stage("capture", dataset, runner=capture, command=("data", "capture"),
          help="capture the target's hidden states for the regenerated samples (token shards only with "
          "training.features online)",
          key=("data.aux_layers", "data.last_hidden", "data.feature_backend", "data.feature_dtype",
               "training.features"),
          by_content={"target": TARGET}, upstream={"regenerated": "regenerate"}),
    Stage("suite_features", suite_features, runner=capture_suites, command=("data", "capture"),
          help="then for the other suites' continuations (the simulator's alone)",
          key=("data.aux_layers", "data.last_hidden", "data.feature_backend", "data.feature_dtype"),
          by_content={"target": TARGET}, upstream={"suites": "suites"}),
    Stage("vocab", vocab_map, runner=vocab, command=("vocab", "build"),
          help="build d2t/t2d from the regenerated training split", key=("vocab",),
          upstream={"regenerated": "regenerate"}),
    Stage("train", trained, runner=train, command=("train",),
          help="train the draft (torchrun as training.* says); a training-only config (no serving, benchmark or "
          "registry section) is enough",
          key=("draft", "training.features", "training.ttt_steps", "training.ttt_step_decay", "training.learning_rate",
               "training.warmup_steps", "training.warmup_start", "training.lr_floor", "training.adam_betas",
               "training.weight_decay", "training.freeze_head", "training.feature_noise",
               "training.teacher_temperature", "training.loss_positions", "training.max_steps", "training.warm_steps",
               "training.patience", "training.min_gain",
               "training.batch_size", "training.seq_len", "training.grad_clip", "training.eval_fraction",
               "training.eval_every", "training.seed", "training.best_by", "training.replay_prompts",
               "training.replay_max_new_tokens", *REPLAY),
          by_content={"training.init_from": ByContent(("training.init_from",), init_draft_content),
                      "counting": COUNTING},
          # the held-out continuations its acceptance replay reads (regenerate's) are pinned by the vocab map's
          # manifest, which records the regenerated fingerprint it was built from
          upstream={"dataset": "capture", "vocab": "vocab"}, resumes=("train",), per_draft=True),
    Stage("export", served_export, runner=export, command=("export",),
          help="write every export.layouts layout; the served one validated as its release loads it",
          # the speculators layout records the serving num_steps as speculative_tokens, names the target as its
          # verifier and ships the target's embedding
          key=("export", "serving.release", "serving.context_length", "serving.num_steps", "target.family",
               "target.num_hidden_layers", "target.path", "target.weight_prefix"),
          # validation holds the draft's aux layers against those the data set's manifest records
          upstream={"trained": "train", "dataset": "capture"}, per_draft=True),
    Stage("simulate", "bench/simulated.json", runner=simulate, command=("simulate",),
          help="offline acceptance: replay drafting over the held-out suites in serving's shape and the sweep's",
          key=(*REPLAY, "benchmark.suites", "sweep.points", "data.thinking"), by_content={"counting": COUNTING},
          # the held-out features (data/heldout, in the data set's manifest) and their requests (regenerate's
          # heldout_greedy.jsonl); the other suites' requests and features
          upstream={"exported": "export", "dataset": "capture", "regenerated": "regenerate", "suites": "suites",
                    "suite_features": "suite_features"},
          needs=("serving", "benchmark"), per_draft=True),
)}

# the run's records under run.dir, each written by one step and read by others
RECORDS = {"simulated": STAGES["simulate"].output, "served": "bench/served.json", "sweep": "bench/sweep.json",
           "suites": "bench/suites.json", "contenders": "bench/contenders.json"}


def output_of(config: PipelineConfig, stage: str) -> Path:
    return under_run(config, STAGES[stage].output)


def under_run(config: PipelineConfig, path: str | Callable[[PipelineConfig], Path]) -> Path:
    return path(config) if callable(path) else config.run.dir / path


def record_path(config: PipelineConfig, record: str) -> Path:
    return config.run.dir / RECORDS[record]


UNCACHED = "read by the steps after simulate (measure, sweep, gate, publish, promote), which run every time"
SPEED = "how fast or where it runs, not what it makes"
OPERATIONAL = {
    "run.name": "names the run in the registry and the logs",
    "run.dir": "where the outputs are; its token is in every key",
    "run.data_from": "where the shared stages' outputs are; its token is in every key",
    "contenders": "each contender's stages are keyed by its own config (eagle3.resolve.contender_configs)",
    "run.keep_runs": "retention of old retrain directories",
    "run.cpu_threads": SPEED,
    "run.warm_start": SPEED,
    "data.sglang_python": "the interpreter SGLang runs in: the same greedy replies",
    "data.sglang_engine_args": "engine flags (memory, attention backend): the same greedy replies",
    "data.batch_size": SPEED,
    "data.shard_samples": "how the same rows are cut into shard files",
    "data.servers": SPEED,
    "data.nodes": SPEED,
    "data.concurrency": SPEED,
    "data.retries": "retries of failed requests: the same replies once answered",
    "data.request_timeout_s": "how long a request may take",
    "data.share_samples": "replies taken from the sample store were made under the same key inputs (its context)",
    "training.recompute": "recomputes activations in the backward: the same gradients, less memory",
    "training.micro_batch_size": "gradient accumulation over the same batch",
    "training.nproc_per_node": SPEED,
    "training.nnodes": SPEED,
    "training.fsdp": "how the same parameters are sharded",
    "training.save_every": "how often checkpoints are written (resume points)",
    "training.keep_last": "how many checkpoints are kept",
    "training.launcher": SPEED,
    "training.hosts": SPEED,
    "training.ssh_args": SPEED,
    "training.rdzv_endpoint": SPEED,
    "training.srun_args": SPEED,
    "training.python": "the interpreter the trainers run in",
    "training.stop_grace_s": "how long a stopped trainer gets to save",
    "training.stream": "where and how streamed features travel: a sample's features are the same (its content key)",
    **{f"serving.{name}": UNCACHED for name in (
        "python", "launcher", "host", "port", "nodes", "tp", "pp", "extra_args", "ssh_host", "ssh_args", "srun_args",
        "health_timeout_s", "log_dir", "gpu_free_mib", "gpu_free_timeout_s")},
    **{f"benchmark.{name}": UNCACHED for name in ("concurrency", "temperature", "request_timeout_s", "retries",
                                                  "baseline")},
    **{f"sweep.{name}": UNCACHED for name in ("enabled", "num_prompts", "budget_s")},
    "gate": UNCACHED,
    "registry": "where versions are published (a warm start's version is keyed by its content)",
    **{f"production.{name}": UNCACHED for name in ("mode", "host", "port", "keep_serving", "state_dir", "supervisor")},
    "production.telemetry.metrics": UNCACHED,
    "production.telemetry.records_dir": UNCACHED,
    "monitor": "the monitor flow's, which caches nothing",
    "node": "the GPU node's figures for `eagle3 plan`'s memory and time estimates",
}
