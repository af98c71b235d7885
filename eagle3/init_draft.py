"""`training.init_from`: the draft a run fine-tunes, a registry version (of config.registry) or a directory in any
layout the project reads (native, sglang, speculators).

It is resolved once, before the trainer starts (`resolve_init_from`): a version is fetched in the sglang layout
(every version has it: our exports and imported drafts alike), a directory is read where it is, and the algorithm
that reads it (its kind must be one the run's algorithm warm starts from: `DraftAlgorithm.warm_start`) writes its
native copy under run.dir/train/init/native with this config's target family, serving release and target layer
count (EAGLE-3's conversion refuses what a loader would misread, such as an absolute d2t). A record beside it says
where it came from; the trainer finds the copy (eagle3/algorithms/init_copy.py), the draft algorithm loads it (its
`initial_model`), and its checkpoints' manifests name the record.

The train stage's cache key holds the init draft's content (`InitDraft.sha256`: the sha256 of config.json and of
each weights file), never its path or version id: another draft at the same path runs the stage again, the same
draft elsewhere does not. A version's files are hashed by the registry's manifest, without a download.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from eagle3.config.deployment import RegistrySection
from eagle3.config.draft import DraftSection
from eagle3.config.run import RunSection, TargetSection
from eagle3.config.serving import ServingSection, replay_shape
from eagle3.config.training import TrainingSection
from eagle3.errors import Eagle3Error
from eagle3.algorithms import algorithm, draft_algorithm
from eagle3.algorithms.base import ExportTarget
from eagle3.draft.files import CONFIG_FILE, is_checkpoint_file
from eagle3.fsutil import atomic_write_json, cached_sha256
from eagle3.registry.registry import RegistryError, open_registry, registry_location, version_algorithm
from eagle3.algorithms.init_copy import NATIVE_DIR, RECORD_FILE, init_dir

Log = Callable[[str], None]
VERSION_LAYOUT = "sglang"  # the layout a version is fetched in
# (registry, version) -> (files, its draft algorithm); versions are immutable
_VERSIONS: dict[tuple[str, str], tuple[dict[str, str], str]] = {}


@dataclass(frozen=True)
class InitDraft:
    init_from: str  # the value as the config gives it
    kind: str  # "version" or "directory"
    where: str  # the registry's location, or the directory's absolute path
    files: dict[str, str]  # config.json and each weights file -> sha256: the draft's content
    algorithm: str  # its kind, a draft.algorithm name

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps(self.files, sort_keys=True).encode()).hexdigest()

    def describe(self) -> str:
        return f"directory {self.where}" if self.kind == "directory" else f"version {self.init_from} of {self.where}"


def init_draft(training: TrainingSection, draft_section: DraftSection,
               registry: RegistrySection | None) -> InitDraft | None:
    """What training.init_from names, with its content's hashes; None when the run trains from scratch. A value
    that is neither a draft directory nor a version of `registry` is refused, naming both places looked at, and
    so is a draft of a kind the run's algorithm (draft.algorithm) does not start from."""
    value = training.init_from
    if value is None:
        return None
    path = Path(value)
    if path.is_dir():
        draft = InitDraft(value, "directory", str(path.resolve()), directory_files(path), draft_algorithm(path).name)
    elif registry is None:
        raise Eagle3Error(f"training.init_from {value!r}: no such directory, and the config has no registry section to "
                          "look it up as a version; give a draft directory (native, sglang or speculators layout) or "
                          "add the registry that holds the version")
    else:
        draft = InitDraft(value, "version", registry_location(registry), *version_files(registry, value))
    if problem := warm_start_problem(draft.algorithm, draft_section.algorithm):
        raise Eagle3Error(f"training.init_from {value!r} ({draft.describe()}): {problem}")
    return draft


def warm_start_problem(kind: str, algorithm_name: str) -> str | None:
    """Why a draft of `kind` cannot start the training of a draft.algorithm `algorithm_name` draft (None: it can)."""
    starts_from = algorithm(algorithm_name).warm_start
    if kind in starts_from:
        return None
    return (f"it is a {kind} draft, and draft.algorithm {algorithm_name} warm starts only from "
            f"{' or '.join(starts_from) or 'no'} drafts; name one of those, or train from scratch (no "
            "training.init_from)")


def directory_files(path: Path) -> dict[str, str]:
    files = {file.name: cached_sha256(file) for file in sorted(path.iterdir())
             if file.is_file() and is_checkpoint_file(file.name)}
    if CONFIG_FILE not in files:
        raise Eagle3Error(f"training.init_from {path}: no {CONFIG_FILE} there, so not a draft checkpoint; point it at "
                          "a draft directory (native, sglang or speculators layout) or name a registry version")
    return files


def version_files(section: RegistrySection, version: str) -> tuple[dict[str, str], str]:
    """The sha256 of the version's sglang files a checkpoint reader reads, and its draft algorithm, from the registry's
    manifest."""
    location = registry_location(section)
    if (location, version) not in _VERSIONS:
        try:
            manifest = open_registry(section, log=lambda line: None).manifest(version)
        except RegistryError as err:
            raise Eagle3Error(f"training.init_from {version!r}: not a directory, nor a version of the registry "
                              f"{location} ({err}); give an existing draft directory, or a version id that "
                              "`eagle3 registry list` shows") from None
        prefix = f"{VERSION_LAYOUT}/"
        files = {name.removeprefix(prefix): entry["sha256"] for name, entry in manifest.get("files", {}).items()
                 if name.startswith(prefix) and is_checkpoint_file(name.removeprefix(prefix))
                 and "/" not in name.removeprefix(prefix)}
        if CONFIG_FILE not in files:
            raise Eagle3Error(f"training.init_from {version!r}: version {version} in {location} has no "
                              f"{VERSION_LAYOUT} draft (layouts: {', '.join(manifest.get('layouts', [])) or 'none'}); "
                              "publish it with its sglang layout, or give a draft directory")
        _VERSIONS[(location, version)] = files, version_algorithm(manifest)
    return _VERSIONS[(location, version)]


def resolve_init_from(run: RunSection, training: TrainingSection, draft_section: DraftSection, target: TargetSection,
                      serving: ServingSection | None, registry: RegistrySection | None,
                      log: Log = print) -> Path | None:
    """Fetch (a version of `registry`) and convert training.init_from to run.dir/train/init/native, recording where it
    came from beside it; return the native copy, or None when the run trains from scratch. The copy is read as the
    target and serving's release and steps (none: a training-only config) number it. Call it before the trainer
    starts (after the stage's marker cleared what other inputs made)."""
    draft = init_draft(training, draft_section, registry)
    if draft is None:
        return None
    out = init_dir(run)
    (out / RECORD_FILE).unlink(missing_ok=True)  # a failed resolution leaves no record: the trainer refuses
    fetched = out / f"fetched-{VERSION_LAYOUT}"
    try:
        if draft.kind == "version":
            source = open_registry(registry, log).fetch(draft.init_from, VERSION_LAYOUT, fetched, overwrite=True)
        else:
            source = Path(draft.init_from)
        kind = draft_algorithm(source)  # what the fetched files are; the manifest said so, they decide
        if problem := warm_start_problem(kind.name, draft_section.algorithm):
            raise Eagle3Error(problem)
        release = serving.release if serving is not None else None
        written_for = ExportTarget(target.family, release, target.num_hidden_layers, replay_shape(serving).num_steps,
                                   None)
        layout = kind.warm_start_copy(source, out / NATIVE_DIR, written_for, draft.describe(), log)
    except Eagle3Error as err:
        raise Eagle3Error(f"training.init_from {draft.init_from!r} ({draft.describe()}): {err}") from None
    finally:
        shutil.rmtree(fetched, ignore_errors=True)  # the native copy is what the trainer reads
    record = {"init_from": draft.init_from, "kind": draft.kind, "where": draft.where, "layout": layout,
              "sha256": draft.sha256}
    atomic_write_json(out / RECORD_FILE, record)
    log(f"train: training.init_from {draft.init_from}: {draft.describe()}, a {kind.name} draft in the {layout} "
        f"layout, sha256 {draft.sha256[:16]}; its native copy is {out / NATIVE_DIR}")
    return out / NATIVE_DIR
