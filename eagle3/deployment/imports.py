"""`eagle3 registry import SOURCE`: a draft trained elsewhere becomes a registry version and, with `as_production`,
production's draft (docs/registry-and-gate.md, "Importing a draft").

- SOURCE is a directory, or a Hugging Face hub id: a path that does not exist is fetched with
  huggingface_hub.snapshot_download where that package is installed, i.e. on the GPU node (tests use directories).
- The draft is validated for the config's target, serving release and data.aux_layers, then converted to the sglang
  layout and validated again (eagle3/validation/external.py). A refusal publishes nothing.
- The version is `import-<16 hex>` of the sha256 over the original files (each name and sha256) and what they were
  converted for (release, family, target layers, data layers): the same files for the same serving are the same
  version, published once. Its manifest records `provenance` (source, layout found, every step, each original file's
  sha256), both validation reports, the config and the lineage.
- A plain import is not measured: no `metrics`, no prompt set. Made production by hand (`eagle3 registry promote
  VERSION --force`), it is measured by the next run on that run's prompts (`production_on_run_prompts`).
- `as_production` measures it first, as the pipeline measures a candidate (the serving section's shape, greedy, on the
  run's benchmark prompts: the data stage must have run), publishes it with those figures and that prompt set, points
  production at it (history: "imported as production"), then serves it on the production endpoint and re-measures it
  against those figures, as after a promotion. Any failure once production was stopped points the pointer back and
  serves the previous version again.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Callable

from eagle3.algorithms import draft_algorithm
from eagle3.config import PipelineConfig, require_sections
from eagle3.resolve import with_draft
from eagle3.deployment.production import Production
from eagle3.deployment.promotion import (
    PROMPTS_LAYOUT,
    benchmark_prompts_file,
    config_fields,
    measure_server,
    measured_fields,
    prompt_ids_in,
)
from eagle3.deployment.sweep import configured_choice
from eagle3.errors import Eagle3Error, UnreadableInput
from eagle3.config.run import TargetSection
from eagle3.config.serving import ServingSection
from eagle3.serving.base import launch_spec
from eagle3.validation.external import Converted, Serving
from eagle3.target.info import read_target_info
from eagle3.fsutil import sha256_file
from eagle3.registry.registry import Registry, RegistryError, open_registry

Log = Callable[[str], None]
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name
IMPORTS_DIR = "imports"  # run.dir/imports/<version>/sglang: the converted export, before it is published
REASON = "imported as production"


class ProductionRefused(Eagle3Error):
    """The imported draft did not become production: its measurement, or production's re-measure, failed."""


def import_draft(config: PipelineConfig, source: str, as_production: bool = False, log: Log = print,
                 by: str = "cli") -> dict:
    """Validate, convert and publish the draft at `source` (once); with `as_production`, measure it and make it
    production. Returns {version, layout_found, published (this call), production (None, or {previous, measured})}."""
    require_sections(config, ("registry", "serving") + (("benchmark",) if as_production else ()),
                      "eagle3 registry import")
    registry = open_registry(config.registry, log)
    path, origin = local_copy(source, log)
    files = file_digests(path)
    serving = serving_of(config.target, config.serving, config.data.aux_layers)
    version = import_version_id(files, serving)
    staged = config.run.dir / IMPORTS_DIR / version / "sglang"
    converted = draft_algorithm(path).convert_external(path, staged, serving, log)
    config = config_for(config, converted)
    fields = import_fields(config_fields(config), origin, converted, files, registry.production_version())
    exists = version in registry.versions()
    if exists:
        log(f"import: version {version} holds these files, converted for this serving, already: nothing published")
    result = {"version": version, "layout_found": converted.layout_found, "published": False, "production": None}
    if as_production:
        result["published"], result["production"] = import_as_production(config, registry, version, staged, fields,
                                                                         exists, log, by)
    elif not exists:
        registry.publish(version, {"sglang": staged}, fields)
        result["published"] = True
        log(f"import: published {version} without figures (not measured): `--as-production` measures it")
    return result


def config_for(config: PipelineConfig, converted: Converted) -> PipelineConfig:
    """The config a converted draft is served, replayed and recorded with: the importing config's, or one with the
    draft's own draft section where its converter gives one (a draft of another kind: its kind and sizes), without
    sweep points of another kind (they are the importing config's kind's shapes)."""
    return config if converted.draft is None else with_draft(config, converted.draft)


def local_copy(source: str, log: Log) -> tuple[Path, dict]:
    """The draft's directory, and where it came from. A path that does not exist is a hub id, fetched where
    huggingface_hub is installed (the GPU node)."""
    path = Path(source).expanduser()
    if path.exists():
        return path, {"source": source, "path": str(path.resolve())}
    if not HUB_ID.fullmatch(source):
        raise UnreadableInput(f"{source}: no such directory (a draft to import is a directory, or a hub id "
                              "owner/name, fetched on the node)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise UnreadableInput(f"{source}: no such directory here, and no huggingface_hub to fetch it as a hub id: hub "
                              "ids are fetched on the GPU node; import a local copy here") from None
    log(f"import: {source} is no directory here: fetching it as a hub id with huggingface_hub")
    try:
        fetched = Path(snapshot_download(repo_id=source))
    except Exception as err:  # the hub's own errors (unknown repo, gated, offline): one line naming the source
        raise UnreadableInput(f"{source}: no such directory, and fetching it from the hub failed: "
                              f"{type(err).__name__}: {err}") from None
    return fetched, {"source": f"hf:{source}", "path": str(fetched), "revision": fetched.name}


def file_digests(directory: Path) -> dict[str, str]:
    """Every file under the draft's directory (relative name -> sha256), the original files as found."""
    files = sorted(path for path in directory.rglob("*") if path.is_file())
    return {path.relative_to(directory).as_posix(): sha256_file(path) for path in files}


def import_version_id(files: dict[str, str], serving: Serving) -> str:
    """import-<16 hex> of the files and what they are converted for: another release may need other aux ids."""
    converted_for = {"release": serving.release, "family": serving.family, "num_layers": serving.num_layers,
                     "data_layers": serving.data_layers}
    digest = hashlib.sha256(json.dumps({"files": files, "for": converted_for}, sort_keys=True).encode())
    return f"import-{digest.hexdigest()[:16]}"


def serving_of(target: TargetSection, serving: ServingSection, aux_layers: list[int]) -> Serving:
    """What a run serves drafts with, as the export stage reads it (the target's directory where it is here; the
    layers its data were captured at: data.aux_layers)."""
    path = Path(target.path)
    here = path if path.is_dir() else None
    return Serving(family=target.family, release=serving.release,
                   num_layers=read_target_info(path).num_hidden_layers if here else target.num_hidden_layers,
                   vocab_size=target.vocab_size, data_layers=list(aux_layers),
                   context_length=serving.context_length, num_steps=serving.num_steps, target=here)


def import_fields(recorded: dict, origin: dict, converted: Converted, files: dict[str, str],
                  parent: str | None) -> dict:
    """The manifest of an imported version, before any measurement (`recorded`: the config it is served with, as
    config_fields records it)."""
    return {
        **recorded,
        "provenance": {**origin, "layout_found": converted.layout_found, "steps": converted.steps, "files": files},
        "validation": converted.validation,
        "metrics": None,
        "lineage": {"parent": parent, "init_from": None, "flow_run": None},
    }


def import_as_production(config: PipelineConfig, registry: Registry, version: str, staged: Path, fields: dict,
                         exists: bool, log: Log, by: str) -> tuple[bool, dict | None]:
    """Measure (unless published with figures already), publish, promote, re-measure on the production endpoint.
    Returns (published by this call, {previous, measured})."""
    before = registry.production_version()
    if before == version:
        log(f"import: {version} is production already: nothing to move")
        return False, None
    if exists and not (registry.manifest(version).get("metrics") or {}).get("served"):
        raise RegistryError(
            f"version {version} (these files) was imported without --as-production and holds no figures; versions "
            f"are immutable: `eagle3 registry promote {version} --force` makes it production, and the next run "
            "measures it on that run's prompts")
    # measured on the run's benchmark prompts: without them it is refused here, before production stops
    prompts_file = None if exists else benchmark_prompts_file(config.benchmark, config.run)
    production = Production(config, registry, log)
    production.release_node()
    try:
        if not exists:
            served = measure_server(launch_spec(config), config.benchmark, staged,
                                    prompt_ids_in(config.data, config.target, prompts_file), log,
                                    role=f"imported draft {version}")
            refuse_unusable(version, served)
            chosen = configured_choice(config.serving, served)
            registry.publish(version, {"sglang": staged, PROMPTS_LAYOUT: prompts_file.parent},
                             fields | measured_fields(config.benchmark, config.run, served, None, chosen))
        registry.promote(version, before, [REASON, f"source: {fields['provenance']['source']}"], by=by)
        measured = production.serve(version, REASON)
        warning = production.check(version, measured, config.gate.production_tolerance)
        if warning:
            raise ProductionRefused(f"{version} did not become production: {warning}")
    except BaseException:
        restore(registry, production, version, before, log, by)
        raise
    return not exists, {"previous": before, "measured": measured}


def refuse_unusable(version: str, served: dict) -> None:
    """A measurement that cannot be production's figures: the gate and the monitor would compare with nothing."""
    if served["lost_requests"]:
        raise ProductionRefused(f"{version}: the benchmark lost {served['lost_requests']} request(s) "
                                f"({served.get('error')}): its figures cannot be trusted; nothing published")
    if served.get("accept_length") is None:
        raise ProductionRefused(f"{version}: the server reported no speculative decoding (no spec_* metrics): "
                                "nothing published")


def restore(registry: Registry, production: Production, version: str, before: str | None, log: Log,
            by: str) -> None:
    """After a failure once production was stopped: the pointer back where it was, that version served again. Each
    step that fails is logged; the caller re-raises the failure itself."""
    steps = []
    if registry.production_version() == version:
        steps.append(lambda: registry.rollback([f"rolled back {version}: its import as production failed"], by=by,
                                               to=before, expected=version))
    steps.append(lambda: production.serve(before, f"restored after {version}'s import failed"))
    for step in steps:
        try:
            step()
        except (Eagle3Error, OSError) as err:
            log(f"import: restoring production {before} failed: {type(err).__name__}: {err}; check "
                f"`eagle3 registry list` and serve it with `eagle3 run CONFIG --mode benchmark`")
