"""Self-describing outputs: every stage writes a manifest.json beside what it produced."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

import eagle3
from eagle3.errors import UnreadableInput
from eagle3.fsutil import atomic_write_json, read_json, sha256_file

MANIFEST_FILE = "manifest.json"
# written for people and hashed never: an output made again with the same content has the same fingerprint, so a
# re-made stage leaves every downstream cache key (and a finished training) as it was
WHEN_WRITTEN = ("created",)


@lru_cache(maxsize=1)
def code_version() -> str:
    """Package version plus a hash of the package source (an installed wheel has no git SHA)."""
    root = Path(eagle3.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return f"{eagle3.__version__}+{digest.hexdigest()[:12]}"


def write_manifest(directory: Path, kind: str, fields: dict) -> dict:
    """Write manifest.json listing every file in `directory` with its size and sha256."""
    directory = Path(directory)
    files = {
        path.relative_to(directory).as_posix(): {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name != MANIFEST_FILE
    }
    manifest = {
        "kind": kind,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "code_version": code_version(),
        "files": files,
        **fields,
    }
    atomic_write_json(directory / MANIFEST_FILE, manifest)
    return manifest


def read_manifest(directory: Path) -> dict:
    return json.loads((Path(directory) / MANIFEST_FILE).read_text())


def fingerprint(path: Path) -> str:
    """Content hash of a stage output: its manifest (which lists every file's sha256) less when it was written, or
    the file itself."""
    path = Path(path)
    if not path.is_dir():
        return sha256_file(path)
    content = {key: value for key, value in read_manifest(path).items() if key not in WHEN_WRITTEN}
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def read_data_capture(path: Path) -> dict:
    """From a dataset manifest: the aux layers captured (our convention) and the target they came from.

    A dataset manifest holds `target: {family, num_hidden_layers, hidden_size, vocab_size, ...}` and
    `capture: {aux_layers, last_hidden, ...}`; a directory means its manifest.json.
    """
    path = Path(path)
    if path.is_dir():
        path = path / MANIFEST_FILE
    manifest = read_json(path, "no such data manifest")
    if not isinstance(manifest, dict) or not isinstance(manifest.get("target") or {}, dict):
        raise UnreadableInput(f"{path}: not a dataset manifest (expected a JSON object)")
    capture, target = manifest.get("capture") or {}, manifest.get("target") or {}
    if not isinstance(capture, dict) or not isinstance(capture.get("aux_layers"), list):
        raise UnreadableInput(f"{path}: not a dataset manifest (capture.aux_layers is missing)")
    return {
        "aux_layers": capture["aux_layers"],
        "num_hidden_layers": target.get("num_hidden_layers"),
        "hidden_size": target.get("hidden_size"),
        "family": target.get("family"),
        "engine": capture.get("engine"),  # the feature backend: local (transformers) or sglang
        "engine_release": capture.get("engine_release"),
    }
