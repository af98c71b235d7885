"""Stage identities for caching: a stage's key is a content hash of what it reads - the config sections it
uses, the fingerprints (manifest hashes) of the stage outputs it consumes, and the code version (a hash of the
package source; an installed wheel has no git SHA). Unchanged inputs give the same key (the stage is skipped);
a changed input changes the key of its stage and, through the fingerprints, of every stage downstream.

The run directory carries a random token made the first time it is used, and every key includes it: a deleted
or replaced run directory never reuses results that described the old one. Each finished output records the key
it was made under (a marker beside it): when a run with other inputs has overwritten it since, the key is not
offered to the cache, so the stage runs again instead of handing on files that changed under it.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

from eagle3.config import PipelineConfig
from eagle3.formats.manifest import MANIFEST_FILE, code_version
from eagle3.fsutil import atomic_write_bytes, sha256_file

TOKEN_FILE = ".run-token"

# stage -> the config sections (or dotted fields) whose values decide its output
STAGE_INPUTS = {
    "regenerate": ("run", "target", "data"),
    "capture": ("run", "target", "data"),
    "vocab": ("run", "vocab"),
    "train": ("run", "draft", "training"),
    "export": ("run", "target", "export", "serving.release", "serving.context_length"),
    "simulate": ("run", "target", "serving.release", "serving.num_steps", "benchmark"),
}


# stage -> its output under run.dir (what the marker sits beside)
STAGE_OUTPUTS = {
    "regenerate": "data/regen",
    "capture": "data/hidden",
    "vocab": "vocab",
    "train": "train/best",
    "export": "export/sglang",
    "simulate": "bench/simulated.json",
}


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
    values = config.model_dump(mode="json")
    picked = {}
    for dotted in STAGE_INPUTS[stage]:
        node = values
        for part in dotted.split("."):
            node = node[part]
        picked[dotted] = node
    return picked


def stage_key(stage: str, config: PipelineConfig, upstream: list[str]) -> str:
    """The cache key of `stage` given the fingerprints of the outputs it consumes."""
    payload = {"stage": stage, "run_token": run_token(config.run.dir), "config": config_inputs(config, stage),
               "upstream": list(upstream), "code": code_version()}
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
    return f"eagle3-{stage}-{digest[:40]}"


def marker(config: PipelineConfig, stage: str) -> Path:
    output = config.run.dir / STAGE_OUTPUTS[stage]
    return output.parent / f".{output.name}.stage-key"


def cache_key(stage: str, config: PipelineConfig, upstream: list[str]) -> str | None:
    """The key to offer the cache, or None when the stage's output was last made under another key."""
    key = stage_key(stage, config, upstream)
    made = marker(config, stage)
    return None if made.is_file() and made.read_text().strip() != key else key


def record_key(stage: str, config: PipelineConfig, upstream: list[str]) -> Path:
    """Mark the stage's fresh output with the key it was made under; return the output."""
    atomic_write_bytes(marker(config, stage), (stage_key(stage, config, upstream) + "\n").encode())
    return config.run.dir / STAGE_OUTPUTS[stage]


def fingerprint(path: Path) -> str:
    """Content hash of a stage output: its manifest (which lists every file's sha256), or the file itself."""
    path = Path(path)
    return sha256_file(path / MANIFEST_FILE if path.is_dir() else path)
