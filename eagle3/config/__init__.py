"""One typed config for a whole pipeline run: its schema, which validates without knowing the kinds of draft or the
serving engines (their names are strings here, a kind's own section is kept as given). eagle3.resolve loads a config
from YAML with dotted `--set` overrides and resolves it against the registries: every config the stages see is one.

Every section forbids unknown fields, so a typo fails at load time with the dotted field name and
the fields that are allowed, instead of silently falling back to a default.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, get_args, get_origin

import yaml
from pydantic import BaseModel, StringConstraints, ValidationError, model_validator

from eagle3.config.base import Section
from eagle3.config.contenders import ContenderSection
from eagle3.config.data import PROMPT_SUFFIXES, DataSection, VocabSection
from eagle3.config.deployment import GateSection, MonitorSection, ProductionSection, RegistrySection
from eagle3.config.draft import DraftSection
from eagle3.config.node import NodeSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.config.serving import BenchmarkSection, ExportSection, ServingSection, SweepSection, replay_shape
from eagle3.config.suites import MTBENCH, TRAFFIC, mtbench_file
from eagle3.config.training import TrainingSection
from eagle3.errors import ConfigError, UnreadableInput
from eagle3.contract.engines import (
    FAMILY_DELEGATES_TO, aux_layers_problem, served_features_problem, sglang_default_inputs, sglang_ids_for_layers,
)
from eagle3.target.info import read_target_info
from eagle3.target.files import (
    THINKING_SWITCHES, TOKENIZER_MODEL_FILES, chat_template_text, thinking_switches, untrusted_code_problem,
)
from eagle3.fsutil import atomic_write_bytes, named_file
from eagle3.shape import DraftShape

# What only the stages after training need: a training-only config leaves them out, and the stages that need them
# say so (require_sections).
DEPLOYMENT_SECTIONS = ("serving", "benchmark", "registry")


class PipelineConfig(Section):
    run: RunSection
    target: TargetSection
    data: DataSection
    vocab: VocabSection
    draft: DraftSection
    training: TrainingSection
    export: ExportSection = ExportSection()
    serving: ServingSection | None = None
    benchmark: BenchmarkSection | None = None
    sweep: SweepSection = SweepSection()
    gate: GateSection = GateSection()
    registry: RegistrySection | None = None
    production: ProductionSection = ProductionSection()
    monitor: MonitorSection = MonitorSection()
    node: NodeSection = NodeSection()
    contenders: dict[Annotated[str, StringConstraints(pattern=r"^[a-z0-9_-]+$")], ContenderSection] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> PipelineConfig:
        training = self.training
        if training.features == "online" and self.data.feature_backend == "sglang" and training.nnodes > 1:
            raise ValueError(
                f"training.features online with data.feature_backend sglang runs the target tensor-parallel over all "
                f"ranks of one node; training.nnodes {training.nnodes} would split it across nodes: use one node "
                "(training.nnodes 1) or training.features offline"
            )
        if self.vocab.draft_vocab_size > self.target.vocab_size:
            raise ValueError(
                f"vocab.draft_vocab_size ({self.vocab.draft_vocab_size}) exceeds target.vocab_size "
                f"({self.target.vocab_size})"
            )
        lengths = [("training.seq_len", self.training.seq_len)]
        if self.serving is not None:
            lengths.insert(0, ("serving.context_length", self.serving.context_length))
        for field, value in lengths:
            if value > self.draft.max_position_embeddings:
                raise ValueError(
                    f"{field} ({value}) exceeds draft.max_position_embeddings "
                    f"({self.draft.max_position_embeddings}); raise the latter"
                )
        if self.serving is None and (self.data.generator != "local" or self.data.feature_backend == "sglang"):
            raise ValueError(f"data.generator {self.data.generator} or data.feature_backend {self.data.feature_backend} runs the "
                             "target on serving.tp GPUs: add a serving section")
        self._check_replay()
        if self.benchmark is not None and TRAFFIC in {s.name for s in self.benchmark.suites} and self.data.traffic is None:
            raise ValueError("benchmark.suites names traffic, production's held-out request prompts: they come from "
                             "data.traffic; add that section or remove the suite")
        return self

    def check_aux_layers(self, defaulted: bool) -> None:
        """data.aux_layers (`defaulted`: the kind's default, filled in by the resolve step) against the target, and
        what the served release captures of them; raises ValueError naming the field."""
        n = self.target.num_hidden_layers
        if problem := aux_layers_problem(self.data.aux_layers, n):
            source = f" (SGLang's default for a {n}-layer target)" if defaulted else ""
            raise ValueError(f"data.aux_layers{source} {problem}")
        self._check_served_capture()

    def _check_served_capture(self) -> None:
        """The export writes the ids that make the served SGLang release capture data.aux_layers on the target's model
        file: a family or release it cannot serve, or one whose capture is not what the draft trains on, is refused
        here, before any data is made, never at the export after training."""
        family, layers, n = self.target.family, self.data.aux_layers, self.target.num_hidden_layers
        release = self.serving.release if self.serving is not None else None
        pair = f"target.family {family} on serving.release {release or '(not given: every release in the table)'}"
        try:
            sglang_ids_for_layers(layers, family, release, n)
        except ValueError as err:
            raise ValueError(f"{pair} cannot be served: {err}; see docs/contracts.md (target families)") from None
        if self.data.feature_backend == "local" and (problem := served_features_problem(family, release)):
            raise ValueError(f"{pair}: {problem}")

    def _check_replay(self) -> None:
        """The held-out greedy sequences are the benchmark's prompts, continued as far as it decodes: the replay
        reads within them. Without a benchmark section the replay's own fields say what the data stage makes."""
        training, bench = self.training, self.benchmark
        if bench is None:
            missing = [f"training.{name}" for name in ("replay_prompts", "replay_max_new_tokens")
                       if getattr(training, name) is None]
            if missing:
                raise ValueError(f"a config without a benchmark section sets {' and '.join(missing)}: the held-out "
                                 "greedy sequences the data stage makes and the trainer's evaluation replays")
            return
        for name, limit in (("prompts", "num_prompts"), ("max_new_tokens", "max_new_tokens")):
            value, most = getattr(training, f"replay_{name}"), getattr(bench, limit)
            if value is not None and value > most:
                raise ValueError(f"training.replay_{name} ({value}) exceeds benchmark.{limit} ({most}): the held-out "
                                 "greedy sequences hold no more")

    @property
    def heldout_set(self) -> tuple[int, int]:
        """(prompts, max_new_tokens) of the held-out greedy sequences the data stage makes: the benchmark's, or
        training.replay_prompts / replay_max_new_tokens in a config without a benchmark section."""
        if self.benchmark is not None:
            return self.benchmark.num_prompts, self.benchmark.max_new_tokens
        return self.training.replay_prompts, self.training.replay_max_new_tokens

    @property
    def replay_shape(self) -> DraftShape:
        """The drafting shape replayed over the held-out sequences: serving's, or DraftShape's defaults."""
        return replay_shape(self.serving)

    def stage_dir(self, stage: str) -> Path:
        return self.run.stage_dir(stage)


def require_sections(config: PipelineConfig, names: tuple[str, ...], by: str) -> None:
    """A stage that needs sections a training-only config may leave out: one line naming the missing ones."""
    missing = [name for name in names if getattr(config, name) is None]
    if missing:
        raise ConfigError(f"{by} needs the config's {', '.join(missing)} section(s), missing here: add them "
                          "(configs/tiny-cpu.yaml shows every section)")


def sglang_default_aux_layers(num_layers: int) -> list[int]:
    """The layers SGLang captures when a draft names none, in our convention.

    The input of layer i is the output of layer i - 1.
    """
    return [i - 1 for i in sglang_default_inputs(num_layers)]


RESOLVED_FILE = "config.resolved.yaml"


def resolved_config_file(config: PipelineConfig) -> Path:
    """Write the run's one resolved config (every default filled in, the target's facts checked) under run.dir and
    return its path: trainers and node commands read this file, never the YAML plus overrides again, so every
    process of a run sees the same config. Written atomically; rewritten on every run."""
    check_target_facts(config)
    text = "# resolved by eagle3 at load-config: defaults filled in; edit the source config, not this file\n"
    text += yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    path = resolved_config_path(config)
    atomic_write_bytes(path, text.encode())
    return path


def resolved_config_path(config: PipelineConfig) -> Path:
    return config.run.dir / RESOLVED_FILE


def check_target_facts(config: PipelineConfig) -> None:
    """When the target is a local model directory, its files must agree with the config: config.json with the target
    section (sizes, and the family its architecture is served by), its auto_map code with target.trust_remote_code
    (transformers would otherwise ask on stdin, or refuse deep in a stage), its chat template with data.thinking.
    `eagle3 config`, `eagle3 run` and the flow's load-config all check here (check_local_inputs)."""
    target = config.target
    path = Path(target.path)
    if not (path / "config.json").is_file():
        return  # a hub id or a path only the GPU node has: `eagle3 plan` reads target.config_file instead
    info = read_target_info(path)
    wrong = [f"target.{key} is {getattr(target, key)} but {path / 'config.json'} says {getattr(info, key)}"
             for key in ("num_hidden_layers", "hidden_size", "vocab_size") if getattr(target, key) != getattr(info, key)]
    if info.family is not None and target.family not in (info.family, FAMILY_DELEGATES_TO.get(info.family)):
        wrong.append(f"target.family is {target.family} but {path / 'config.json'} names architecture "
                     f"{info.architecture}, which SGLang serves with its {info.family} model file")
    if wrong:
        raise ConfigError("; ".join(wrong) + ": correct the config (the target's own file is what the engines read)")
    check_target_trust(config)
    if config.data.thinking and not thinking_switches(template := chat_template_text(path)):
        where = "has no chat template" if template is None else "has a chat template that reads no thinking switch"
        raise ConfigError(f"data.thinking is true but the target {path} {where} (none of "
                          f"{', '.join(THINKING_SWITCHES)}): it would render thinking and non-thinking prompts "
                          "alike; set data.thinking: false")


def check_target_trust(config: PipelineConfig) -> None:
    """A local target whose auto_map names Python code loads only with target.trust_remote_code: refused here, in one
    line, rather than by transformers in a stage (every step command checks this at config load)."""
    target = config.target
    if not target.trust_remote_code and (problem := untrusted_code_problem(Path(target.path))):
        raise ConfigError(f"target.trust_remote_code is false but {problem}: set target.trust_remote_code: true "
                          "if you trust that code (the remote-code extra installs tiktoken for Kimi's tokenizer)")


def check_local_inputs(config: PipelineConfig) -> None:
    """Before any work: every local path the config names is there, or one line naming the field, the path and the
    fix (never a model-hub error for a directory that is missing). A target that lives only on the GPU node (or on
    a model hub) is declared by target.config_file; its path is not checked here."""
    target = Path(config.target.path)
    if config.target.config_file is None or target.exists():
        if not (target / "config.json").is_file():
            raise ConfigError(
                f"target.path {target}: no model directory there (no config.json); for the tiny target run "
                f"`eagle3 make-tiny-target {target}`, otherwise point target.path at a local model directory (or set "
                "target.config_file when the model is only on the GPU node)")
        if not any((target / name).is_file() for name in TOKENIZER_MODEL_FILES):
            raise ConfigError(f"target.path {target}: no tokenizer there (none of {', '.join(TOKENIZER_MODEL_FILES)}); "
                              "copy the model's tokenizer files next to its config.json")
        check_target_facts(config)
    prompts = config.data.prompts
    try:
        local = None if prompts.startswith(("builtin:", "s3://")) else named_file(prompts, PROMPT_SUFFIXES)
    except UnreadableInput as err:  # pkg:NAME of a package that is not installed, or ships no single prompt file
        raise ConfigError(f"data.prompts: {err}") from None
    if local is not None and not local.is_file():
        raise ConfigError(f"data.prompts {prompts}: no such file; give a JSONL or JSON-array file, builtin:pydoc, "
                          "pkg:NAME or an s3:// URI")
    traffic = config.data.traffic
    if traffic is not None and not traffic.records.startswith("s3://") and not Path(traffic.records).is_dir():
        raise ConfigError(f"data.traffic.records {traffic.records}: no such directory; point it at production's request "
                          "records (production.telemetry.records_dir) or an s3://bucket/prefix, or remove data.traffic")
    for suite in config.benchmark.suites if config.benchmark else ():
        if suite.path is not None and not suite.path.is_file():
            raise ConfigError(f"benchmark.suites {suite.name}: {suite.path}: no such file; give a JSONL of its prompts")
        if suite.name == MTBENCH:
            try:
                mtbench_file()
            except UnreadableInput as err:  # before any sample is made, not after the regeneration
                raise ConfigError(f"benchmark.suites mtbench: {err}") from None
    imported = config.data.import_path
    if imported is not None and not imported.is_file():
        raise ConfigError(f"data.import_path {imported}: no such file; give the JSONL of rows to import, or remove the "
                          "field to regenerate the answers")
    if config.registry is not None and config.registry.backend == "local":
        existing = config.registry.path
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            raise ConfigError(f"registry.path {config.registry.path}: {existing} is not a writable directory; point "
                              "registry.path somewhere this user can write")


def draft_label(config: PipelineConfig) -> str:
    """What a run's own draft is called beside its contenders: its algorithm."""
    return config.draft.algorithm


def describe_errors(path: Path, err: ValidationError, overridden: set[str], within: tuple[str, ...] = (),
                    model: type[BaseModel] = PipelineConfig) -> str:
    """One line per error of validating `model` (the config, or the section at `within`: a kind's own, which the
    resolve step validates), naming `path`, the dotted field (marked when --set gave it) and what is wrong."""
    lines = []
    for error in err.errors():
        loc = tuple(str(part) for part in error["loc"])
        dotted = ".".join(within + loc)
        origin = " (from --set)" if dotted in overridden else ""
        if error["type"] == "extra_forbidden":
            allowed = ", ".join(allowed_fields(loc[:-1], model))
            message = f"unknown field; allowed here: {allowed}"
        elif error["type"] == "missing":
            message = "required field is missing"
        else:
            message = error["msg"].removeprefix("Value error, ")
            if "input" in error and not isinstance(error["input"], dict):
                message += f" (got {error['input']!r})"
        lines.append(f"{path}: {dotted}{origin}: {message}" if dotted else f"{path}: {message}")
    return "\n".join(lines)


def allowed_fields(loc: tuple[str, ...], model: Any = PipelineConfig) -> list[str]:
    parts = iter(loc)
    for part in parts:
        annotation = model.model_fields[part].annotation
        model = section_in(annotation)
        if any(get_origin(a) is dict for a in (annotation, *get_args(annotation))):
            next(parts, None)  # a mapping of sections (contenders): the next part is its key
    return sorted(model.model_fields)


def section_in(annotation: Any) -> Any:
    """The section a field holds: the annotation itself, or the one in an optional section (`ServingSection | None`)
    or a mapping of them."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((found for arg in get_args(annotation) if (found := section_in(arg)) is not None), None)
