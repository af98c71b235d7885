"""A config resolved against the registries (docs/configuration.md, "How a config is read").

The schema (eagle3.config) validates a config without knowing the kinds of draft or the serving engines: their names
are strings there, and a kind's own section (`draft.<algorithm>`) is kept as given. This step checks `draft.algorithm`
and `serving.engine` against the registries (eagle3.algorithms, eagle3.serving), puts the kind's typed section in
place of the one given, fills in the target layers the kind's draft reads where data.aux_layers names none, and
refuses what the kind says the config cannot hold (`DraftAlgorithm.config_problem`); then each contender, a config
of its own, is resolved the same way. Every config the library works with comes from here: loaded (`load_config`),
derived from another (`derived`, `with_draft`) or a run's contender (`contender_configs`). Each refusal is a
ConfigError naming the file, the field and the fix.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import ValidationError

from eagle3.algorithms import ALGORITHMS
from eagle3.algorithms.base import DraftAlgorithm
from eagle3.config import PipelineConfig, describe_errors, draft_label
from eagle3.config.contenders import CONTENDERS_DIR, SHAPE_FIELDS, SHARED_TRAINING
from eagle3.config.draft import DraftSection
from eagle3.config.files import apply_override, merged_sections, read_config_file
from eagle3.config.training import TrainingSection
from eagle3.errors import ConfigError
from eagle3.runtime.backends import FEATURE_BACKENDS
from eagle3.serving import ENGINES


def load_config(path: str | Path, overrides: list[str] = ()) -> PipelineConfig:
    """Load a YAML config, apply `section.field=value` overrides, and validate and resolve the result."""
    path = Path(path)
    raw = read_config_file(path)
    overridden = {apply_override(raw, item) for item in overrides}
    return resolved(raw, path, overridden)


def resolved(raw: dict, where: Path, overridden: set[str] = frozenset()) -> PipelineConfig:
    """`raw` validated by the schema and resolved against the registries; a refusal names `where` and the field,
    marked where --set (`overridden`) gave it."""
    try:
        config = PipelineConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_errors(where, err, overridden)) from None
    entry = typed_draft(config.draft, where, overridden)
    if config.serving is not None and config.serving.engine not in ENGINES:
        raise ConfigError(unregistered(where, overridden, "serving.engine", config.serving.engine, ENGINES,
                                       "docs/serving-and-benchmark.md"))
    if config.data.feature_backend not in FEATURE_BACKENDS:
        raise ConfigError(unregistered(where, overridden, "data.feature_backend", config.data.feature_backend,
                                       FEATURE_BACKENDS, "docs/data.md"))
    defaulted = config.data.aux_layers is None
    try:
        if defaulted:
            config.data.aux_layers = entry.default_aux_layers(config.target.num_hidden_layers, config.draft)
        config.check_aux_layers(defaulted)
    except ValueError as err:
        raise ConfigError(f"{where}: {err}") from None
    if problem := entry.config_problem(config.draft, config.target, config.serving, config.sweep):
        raise ConfigError(f"{where}: {problem}")
    try:
        contender_configs(config)
    except ConfigError as err:  # each line names the contender
        raise ConfigError(f"{where}: {str(err).replace(chr(10), '; ')}") from None
    return config


def typed_draft(draft: DraftSection, where: Path, overridden: set[str] = frozenset()) -> DraftAlgorithm:
    """The entry `draft.algorithm` names, its own section (draft.<name>) validated by the entry's type and put in
    place of the one given; a section of no kind, or of another kind than the draft's, is refused."""
    entry = ALGORITHMS.get(draft.algorithm)
    if entry is None:
        raise ConfigError(unregistered(where, overridden, "draft.algorithm", draft.algorithm, ALGORITHMS,
                                       "docs/algorithms.md"))
    kinds = sorted(name for name, kind in ALGORITHMS.items() if kind.section_type is not None)
    sections = draft.model_extra  # the fields beyond the draft section's own
    for name in [name for name, section in sections.items() if section is None]:
        del sections[name]  # given as null: left out (as configs recorded before the kinds owned their sections hold)
    for name in sections:
        field = f"draft.{name}"
        if name not in kinds:
            allowed = ", ".join(sorted([*DraftSection.model_fields, *kinds]))
            raise ConfigError(f"{where}: {field}{origin(field, overridden)}: unknown field; allowed here: {allowed}")
        if name != entry.name:
            raise ConfigError(f"{where}: {field}{origin(field, overridden)}: describes a {name} draft, but "
                              f"draft.algorithm is {entry.name}: set draft.algorithm {name} or remove {field}")
    if entry.section_type is None:
        return entry
    fields = entry.section_type.model_fields
    if entry.name not in sections and (needed := [name for name, info in fields.items() if info.is_required()]):
        raise ConfigError(f"{where}: draft.algorithm {entry.name} needs " + "; ".join(
            f"draft.{entry.name}.{name}: {fields[name].description or 'required'}" for name in needed))
    try:
        setattr(draft, entry.name, entry.section_type.model_validate(sections.get(entry.name, {})))
    except ValidationError as err:
        raise ConfigError(describe_errors(where, err, overridden, ("draft", entry.name), entry.section_type)) from None
    return entry


def resolved_draft(raw: dict) -> DraftSection:
    """A draft section alone (one a process was handed as JSON), its kind's section typed."""
    where = Path("a draft section")
    try:
        draft = DraftSection.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(describe_errors(where, err, set(), ("draft",), DraftSection)) from None
    typed_draft(draft, where)
    return draft


def origin(field: str, overridden: set[str]) -> str:
    return " (from --set)" if any(name == field or name.startswith(field + ".") for name in overridden) else ""


def unregistered(where: Path, overridden: set[str], field: str, name: str, registry: dict, docs: str) -> str:
    names = [repr(known) for known in sorted(registry)]
    choices = f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]
    return f"{where}: {field}{origin(field, overridden)}: {name!r} is not registered; give {choices} (see {docs})"


def derived(config: PipelineConfig, changes: dict[str, object]) -> PipelineConfig:
    """A copy of `config` with `changes` ({"section.field": value}) applied and resolved as a loaded config is (a
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
    return resolved(raw, Path(f"{config.run.name} (derived)"))


def with_draft(config: PipelineConfig, draft: dict) -> PipelineConfig:
    """`config` serving the one draft the draft section `draft` describes (a registry version's, an imported draft's):
    its kind and sizes, no contenders, and no sweep points where it is of another kind (they are the config's kind's
    shapes, which another kind may not draft)."""
    other_kind = {"sweep.points": []} if draft.get("algorithm", "eagle3") != config.draft.algorithm else {}
    return derived(config, {"draft": draft, "contenders": None, **other_kind})


def draft_configs(config: PipelineConfig) -> dict[str, PipelineConfig]:
    """Every draft the run trains, by label: its own first, then each contender's config."""
    return {draft_label(config): config, **contender_configs(config)}


def contender_configs(config: PipelineConfig) -> dict[str, PipelineConfig]:
    """Each contender's config, resolved: the run's with the contender's fields over it, its outputs under
    run.dir/contenders/<name>, the run's data and vocab map read from run.dir (run.data_from). Refused, naming the
    contender, where it would not be trained on the run's data or fails the run's checks."""
    made = {}
    for name, own in (config.contenders or {}).items():
        where = f"contenders.{name}"
        if name == draft_label(config):
            raise ConfigError(f"{where}: the run's own draft is called {name} (its draft.algorithm); name the "
                              "contender otherwise")
        if extra := sorted(set(own.serving) - set(SHAPE_FIELDS)):
            raise ConfigError(f"{where}.serving: {', '.join(extra)}: a contender is served as the run is; it sets only "
                              f"its shape ({', '.join(SHAPE_FIELDS)})")
        raw = merged_sections({k: v for k, v in config.model_dump().items() if k != "contenders"},
                              own.model_dump(exclude_unset=True))
        raw["run"] |= {"dir": config.run.dir / CONTENDERS_DIR / name, "data_from": config.run.data_dir}
        if own.serving:  # its own shape: what it leaves out takes the defaults, not the run's resolved values
            raw["serving"] = {k: v for k, v in raw["serving"].items() if k not in SHAPE_FIELDS or k in own.serving}
        if raw["draft"]["algorithm"] != config.draft.algorithm and "init_from" not in own.training:
            raw["training"]["init_from"] = None  # the run's warm start is a draft of its own kind
        contender = resolved(raw, Path(where))
        if changed := shared_inputs_changed(config.training, contender.training):
            raise ConfigError(f"{where}: {', '.join(changed)} differ(s) from the run's: a contender trains on the "
                              "run's data, made once for the run's settings; set them in the run's sections")
        made[name] = contender
    return made


def shared_inputs_changed(run: TrainingSection, contender: TrainingSection) -> list[str]:
    """What the stages every draft of the run shares (data, capture, vocab) read of the contender's sections, where it
    differs from the run's."""
    return [f"training.{name}" for name in SHARED_TRAINING if getattr(run, name) != getattr(contender, name)]
