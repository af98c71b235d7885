"""Stage identities for caching: a stage's key is a content hash of what it reads - the config fields its entry in
eagle3.stages.table names, the content its by-content fields point at (the target, the prompt source, imported rows,
the draft training starts from), the fingerprints (manifest hashes) of the stage outputs it consumes, and the code
version (a hash of the package source; an installed wheel has no git SHA). Unchanged inputs give the same key (the stage is skipped); a changed input
changes the key of its stage and, through the fingerprints, of every stage downstream. Operational fields (ports,
concurrency, retries, launchers) are in no key.

The run directory carries a random token made the first time it is used, and every key includes it: a deleted
or replaced run directory never reuses results that described the old one.

Each output is marked with the key it was made under (a file beside it): "in progress" while the stage runs,
the key once it finished. The cache is offered a key only when the output is there and finished under that very
key (or the stage never ran here): a run with other inputs that overwrote the output, or that failed half way,
makes the stage run again. And a stage that resumes from what its directory holds (regeneration by prompt,
training from checkpoints) starts afresh when its inputs changed, instead of resuming work made for others; the
marker records those inputs, so the log names each one that changed.

The files decide, not the orchestrator's memory: an output finished under the key its inputs give now is done
(`done`), whatever Prefect's result store holds (a fresh PREFECT_HOME, a reset database, expired results). And a
fingerprint hashes content, never when it was written (eagle3.records.manifest.fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from eagle3.config import PipelineConfig
from eagle3.export import export_dirs
from eagle3.records.manifest import code_version, fingerprint
from eagle3.fsutil import atomic_write_bytes
from eagle3.stages.table import STAGES, output_of, under_run

TOKEN_FILE = ".run-token"
IN_PROGRESS = "in-progress "


def run_token(run_dir: Path) -> str:
    """The run directory's token, created (atomically, once) on first use."""
    path = Path(run_dir) / TOKEN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return path.read_text().strip()
    token = uuid.uuid4().hex
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def config_inputs(config: PipelineConfig, stage: str) -> dict:
    """The values of the config fields the stage's key covers, and what its by-content fields point at."""
    values = config.model_dump(mode="json")
    picked = {}
    for dotted in STAGES[stage].key:
        node = values
        for part in dotted.split("."):
            node = None if node is None else node[part]  # a section a training-only config leaves out: None
        picked[dotted] = node
    picked.update({name: item.value(config) for name, item in STAGES[stage].by_content.items()})
    return picked


def stage_key(stage: str, config: PipelineConfig, upstream: dict[str, str]) -> str:
    """The key of `stage` given the fingerprints of the outputs it consumes ({parameter name: fingerprint})."""
    return keyed(key_inputs(stage, config_inputs(config, stage), upstream, config))


def resume_inputs(stage: str, config: PipelineConfig, upstream: dict[str, str]) -> dict:
    """What the stage resumes from was made for: its inputs less the fields that only refine the output."""
    inputs = {k: v for k, v in config_inputs(config, stage).items() if k not in STAGES[stage].refines}
    return key_inputs(stage, inputs, upstream, config)


def key_inputs(stage: str, inputs: dict, upstream: dict[str, str], config: PipelineConfig) -> dict:
    return {"stage": stage, "run_token": run_token(config.run.data_dir), "config": inputs, "upstream": dict(upstream),
            "code": code_version()}


def keyed(payload: dict) -> str:
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return f"eagle3-{payload['stage']}-{digest[:40]}"


def stage_fingerprint(config: PipelineConfig, stage: str) -> str:
    """The content hash a stage hands on: its output's; the export's covers every layout, as a registry version
    publishes them all (and is named after this hash)."""
    if stage != "export":
        return fingerprint(output_of(config, stage))
    layouts = {layout: fingerprint(path) for layout, path in export_dirs(config.run, config.export).items()}
    return hashlib.sha256(json.dumps(layouts, sort_keys=True).encode()).hexdigest()


def marker(config: PipelineConfig, stage: str) -> Path:
    output = output_of(config, stage)
    return output.parent / f".{output.name}.stage-key"


def recorded(config: PipelineConfig, stage: str) -> tuple[str | None, str | None, dict | None]:
    """(the stage key, the resume key, the inputs the resume key hashes) the output was last marked with; None
    where there is none (a marker written before the inputs were recorded has two lines)."""
    made = marker(config, stage)
    key, resumes, inputs = ((made.read_text().splitlines() if made.is_file() else []) + [None] * 3)[:3]
    return key, resumes, (None if inputs is None else json.loads(inputs))


def recorded_key(config: PipelineConfig, stage: str) -> str | None:
    return recorded(config, stage)[0]


def cache_key(stage: str, config: PipelineConfig, upstream: dict[str, str]) -> str | None:
    """The key to offer the cache, or None when the output is not what that key describes."""
    key = stage_key(stage, config, upstream)
    if recorded_key(config, stage) is None and not output_of(config, stage).exists():
        return key  # never ran here
    return key if finished_under(config, stage, key) else None


def done(stage: str, config: PipelineConfig, upstream: dict[str, str]) -> bool:
    """Whether the output is there and finished under the key these inputs give: nothing to make again."""
    return finished_under(config, stage, stage_key(stage, config, upstream))


def finished_under(config: PipelineConfig, stage: str, key: str) -> bool:
    return recorded_key(config, stage) == key and output_of(config, stage).exists()


def begin(stage: str, config: PipelineConfig, upstream: dict[str, str], log: Callable[[str], None]) -> None:
    """Before the stage runs: clear what it would resume from if that was made for other inputs (naming each input
    that changed); mark it running."""
    inputs = resume_inputs(stage, config, upstream)
    key, resumes, made_for = recorded(config, stage)
    if key is not None and resumes != keyed(inputs):
        for path in (under_run(config, resumed) for resumed in STAGES[stage].resumes):
            if path.exists():
                log(f"{stage}: its inputs changed since {path} was made ({changed_inputs(made_for, inputs)}): "
                    "starting it afresh")
                shutil.rmtree(path)
    mark(stage, config, upstream, IN_PROGRESS)


def changed_inputs(before: dict | None, now: dict) -> str:
    """Each input whose value differs, `name: before -> now` (fingerprints and long values shortened)."""
    if before is None:
        return "its marker predates the record of its inputs"
    old, new = flattened(before), flattened(now)
    return "; ".join(f"{name}: {shortened(old.get(name))} -> {shortened(new.get(name))}"
                     for name in sorted(old.keys() | new.keys()) if old.get(name) != new.get(name))


def flattened(value, prefix: str = "") -> dict:
    """{dotted name: leaf value} of nested dicts."""
    if not isinstance(value, dict) or not value:
        return {prefix: value}
    return {name: leaf for key, sub in value.items()
            for name, leaf in flattened(sub, f"{prefix}.{key}" if prefix else key).items()}


def shortened(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 24 else text[:16] + "..."


def finish(stage: str, config: PipelineConfig, upstream: dict[str, str]) -> Path:
    """Mark the stage's output finished under its key; return the output."""
    mark(stage, config, upstream)
    return output_of(config, stage)


def mark(stage: str, config: PipelineConfig, upstream: dict[str, str], prefix: str = "") -> None:
    """The marker: the stage key (prefixed while in progress), the resume key, and the inputs that one hashes."""
    inputs = resume_inputs(stage, config, upstream)
    text = f"{prefix}{stage_key(stage, config, upstream)}\n{keyed(inputs)}\n{json.dumps(inputs, sort_keys=True)}\n"
    atomic_write_bytes(marker(config, stage), text.encode())
