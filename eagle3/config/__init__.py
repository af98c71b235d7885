"""One typed config for a whole pipeline run, loaded from YAML with dotted `--set` overrides.

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
from eagle3.config.contenders import CONTENDERS_DIR, SHAPE_FIELDS, SHARED_TRAINING, ContenderSection
from eagle3.config.data import PROMPT_SUFFIXES, DataSection, VocabSection
from eagle3.config.deployment import GateSection, MonitorSection, ProductionSection, RegistrySection
from eagle3.config.draft import DraftSection
from eagle3.config.files import apply_override, merged_sections, read_config_file
from eagle3.config.node import NodeSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.config.serving import BenchmarkSection, ExportSection, ServingSection, SweepSection
from eagle3.config.suites import MTBENCH, TRAFFIC, mtbench_file
from eagle3.config.training import TrainingSection
from eagle3.errors import ConfigError, UnreadableInput
from eagle3.contract.engines import (
    FAMILY_DELEGATES_TO, FLAG_CONFIG_KEYS, aux_layers_problem, served_draft_problem, served_features_problem,
    sglang_default_inputs, sglang_ids_for_layers,
)
from eagle3.contract.dflash import dflash_default_layer_ids, dflash_family_problem, dflash_rope_problem, dflash_shape_problem
from eagle3.target.info import read_target_info
from eagle3.target.files import (
    THINKING_SWITCHES, TOKENIZER_MODEL_FILES, chat_template_text, thinking_switches, untrusted_code_problem,
)
from eagle3.fsutil import atomic_write_bytes, named_file
from eagle3.shape import DEFAULT_NUM_STEPS, DraftShape

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
        n = self.target.num_hidden_layers
        defaulted = self.data.aux_layers is None
        if defaulted:
            self.data.aux_layers = self._default_aux_layers()
        if problem := aux_layers_problem(self.data.aux_layers, n):
            source = f" (SGLang's default for a {n}-layer target)" if defaulted else ""
            raise ValueError(f"data.aux_layers{source} {problem}")
        self._check_served_capture()
        training = self.training
        if training.features == "online" and self.data.capture_engine == "sglang" and training.nnodes > 1:
            raise ValueError(
                f"training.features online with data.capture_engine sglang runs the target tensor-parallel over all "
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
        if self.serving is None and (self.data.engine != "local" or self.data.capture_engine == "sglang"):
            raise ValueError(f"data.engine {self.data.engine} or data.capture_engine {self.data.capture_engine} runs the "
                             "target on serving.tp GPUs: add a serving section")
        self._check_replay()
        if self.draft.algorithm == "dflash":
            self._check_dflash()
        if self.benchmark is not None and TRAFFIC in {s.name for s in self.benchmark.suites} and self.data.traffic is None:
            raise ValueError("benchmark.suites names traffic, production's held-out request prompts: they come from "
                             "data.traffic; add that section or remove the suite")
        contender_configs(self)  # each one's refusal names it
        return self

    def _default_aux_layers(self) -> list[int]:
        """The layers SGLang captures when the draft names none: EAGLE-3's three, or DFlash's one per draft layer."""
        n = self.target.num_hidden_layers
        if self.draft.algorithm == "dflash":
            try:
                return dflash_default_layer_ids(n, self.draft.dflash.num_layers)
            except ValueError as err:
                raise ValueError(f"data.aux_layers: {err}") from None
        return sglang_default_aux_layers(n)

    def _check_dflash(self) -> None:
        """A DFlash draft proposes one chain a step, in blocks no longer than it was trained on: serving's shape and
        every sweep point must be such a chain."""
        if problem := dflash_family_problem(self.target.family):
            raise ValueError(f"draft.algorithm dflash with target.family {self.target.family}: {problem}")
        release = self.serving.release if self.serving is not None else None
        if release is not None and (problem := dflash_rope_problem(release, self.draft.rope_theta)):
            raise ValueError(f"draft.algorithm dflash, serving.release {release}: {problem}")
        mask = self.draft.dflash.mask_token_id
        if mask >= self.target.vocab_size:
            raise ValueError(f"draft.dflash.mask_token_id {mask} is outside the target's vocabulary (0 .. "
                             f"{self.target.vocab_size - 1}): SGLang refuses it; pick an id of the target's embedding")
        block = self.draft.dflash.block_size
        shapes = [("serving", self.replay_shape)]
        shapes += [(f"sweep.points[{i}]", DraftShape(*point)) for i, point in enumerate(self.sweep.points)]
        for field, shape in shapes:
            if problem := dflash_shape_problem(block, shape):
                raise ValueError(f"draft.algorithm dflash, {field}: {problem}; give chains (eagle_topk 1) of up to "
                                 f"{block - 1} steps (draft.dflash.block_size {block})"
                                 f"{'' if self.serving else ': add a serving section'}")

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
        if self.data.capture_engine == "local" and (problem := served_features_problem(family, release)):
            raise ValueError(f"{pair}: {problem}")
        draft = self.draft
        switches = [name for name in FLAG_CONFIG_KEYS if getattr(draft, name)]
        if problem := served_draft_problem(draft.attention, switches, release):
            raise ValueError(f"draft.attention {draft.attention} with {switches or 'no switches'}: {problem}")

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
        return self.serving.shape if self.serving is not None else DraftShape(DEFAULT_NUM_STEPS)

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


def load_config(path: str | Path, overrides: list[str] = ()) -> PipelineConfig:
    """Load a YAML config, apply `section.field=value` overrides, and validate the result."""
    path = Path(path)
    raw = read_config_file(path)
    overridden = set()
    for item in overrides:
        overridden.add(apply_override(raw, item))
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_errors(path, err, overridden)) from None


def derived(config: PipelineConfig, changes: dict[str, object]) -> PipelineConfig:
    """A copy of `config` with `changes` ({"section.field": value}) applied and validated as a loaded config is (a
    sweep point, production's serving endpoint, a chosen recompute): a change the config refuses is a ConfigError
    naming the field, never a copy that skipped the checks."""
    raw = config.model_dump()
    for dotted, value in changes.items():
        *sections, field = dotted.split(".")
        node = raw
        for name in sections:
            if node.get(name) is None:
                raise ConfigError(f"{dotted}: the config has no {name} section to change")
            node = node[name]
        node[field] = value
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_errors(Path(f"{config.run.name} (derived)"), err, set())) from None


def with_draft(config: PipelineConfig, draft: dict) -> PipelineConfig:
    """`config` serving the one draft the draft section `draft` describes (a registry version's, an imported draft's):
    its kind and sizes, no contenders, and no sweep points where it is of another kind (they are the config's kind's
    shapes: a DFlash draft is never served in EAGLE-3's trees)."""
    other_kind = {"sweep.points": []} if draft.get("algorithm", "eagle3") != config.draft.algorithm else {}
    return derived(config, {"draft": draft, "contenders": None, **other_kind})


def draft_label(config: PipelineConfig) -> str:
    """What a run's own draft is called beside its contenders: its algorithm."""
    return config.draft.algorithm


def draft_configs(config: PipelineConfig) -> dict[str, PipelineConfig]:
    """Every draft the run trains, by label: its own first, then each contender's config."""
    return {draft_label(config): config, **contender_configs(config)}


def contender_configs(config: PipelineConfig) -> dict[str, PipelineConfig]:
    """Each contender's config: the run's with the contender's fields over it, its outputs under
    run.dir/contenders/<name>, the run's data and vocab map read from run.dir (run.data_from). Refused, naming the
    contender, where it would not be trained on the run's data or fails the run's checks."""
    made = {}
    for name, own in (config.contenders or {}).items():
        if name == draft_label(config):
            raise ValueError(f"contenders.{name}: the run's own draft is called {name} (its draft.algorithm); name the "
                             "contender otherwise")
        if extra := sorted(set(own.serving) - set(SHAPE_FIELDS)):
            raise ValueError(f"contenders.{name}.serving: {', '.join(extra)}: a contender is served as the run is; it "
                             f"sets only its shape ({', '.join(SHAPE_FIELDS)})")
        raw = merged_sections({k: v for k, v in config.model_dump().items() if k != "contenders"},
                              own.model_dump(exclude_unset=True))
        raw["run"] |= {"dir": config.run.dir / CONTENDERS_DIR / name, "data_from": config.run.data_dir}
        if own.serving:  # its own shape: what it leaves out takes the defaults, not the run's resolved values
            raw["serving"] = {k: v for k, v in raw["serving"].items() if k not in SHAPE_FIELDS or k in own.serving}
        if raw["draft"]["algorithm"] != config.draft.algorithm and "init_from" not in own.training:
            raw["training"]["init_from"] = None  # the run's warm start is a draft of its own kind
        try:
            contender = PipelineConfig.model_validate(raw)
        except ValidationError as err:
            raise ValueError(describe_errors(Path(f"contenders.{name}"), err, set()).replace("\n", "; ")) from None
        if changed := shared_inputs_changed(config, contender):
            raise ValueError(f"contenders.{name}: {', '.join(changed)} differ(s) from the run's: a contender trains on "
                             "the run's data, made once for the run's settings; set them in the run's sections")
        made[name] = contender
    return made


def shared_inputs_changed(config: PipelineConfig, contender: PipelineConfig) -> list[str]:
    """What the stages every draft of the run shares (data, capture, vocab) read of the contender's sections, where it
    differs from the run's."""
    return [f"training.{name}" for name in SHARED_TRAINING
            if getattr(config.training, name) != getattr(contender.training, name)]


def describe_errors(path: Path, err: ValidationError, overridden: set[str]) -> str:
    lines = []
    for error in err.errors():
        loc = tuple(str(part) for part in error["loc"])
        dotted = ".".join(loc)
        origin = " (from --set)" if dotted in overridden else ""
        if error["type"] == "extra_forbidden":
            allowed = ", ".join(allowed_fields(loc[:-1]))
            message = f"unknown field; allowed here: {allowed}"
        elif error["type"] == "missing":
            message = "required field is missing"
        else:
            message = error["msg"].removeprefix("Value error, ")
            if "input" in error and not isinstance(error["input"], dict):
                message += f" (got {error['input']!r})"
        lines.append(f"{path}: {dotted}{origin}: {message}" if dotted else f"{path}: {message}")
    return "\n".join(lines)


def allowed_fields(loc: tuple[str, ...]) -> list[str]:
    model: Any = PipelineConfig
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
