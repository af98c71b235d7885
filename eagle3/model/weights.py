"""The target's tensors a draft takes: its embedding and head, read tensor by tensor through the safetensors index
(never the whole target), and the verifier a layout that names the target ships. A draft's own weights, as served, are
its algorithm's (EAGLE-3's: eagle3/algorithms/eagle3/served.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3.errors import UnreadableInput
from eagle3.draft.files import Verifier
from eagle3.target.info import read_target_info

TARGET_HEAD = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def target_weight_map(target_dir: Path) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it."""
    index = Path(target_dir) / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = Path(target_dir) / "model.safetensors"
    with safe_open(single, framework="pt") as f:
        return {name: single.name for name in f.keys()}


def read_target_tensors(target_dir: Path, names: list[str], prefix: str = "") -> dict[str, torch.Tensor]:
    """Read tensors `prefix + name` from a (sharded) safetensors checkpoint through its index; keyed by prefixed
    name."""
    target_dir = Path(target_dir)
    weight_map = target_weight_map(target_dir)
    missing = [name for name in names if prefix + name not in weight_map]
    if missing:
        raise UnreadableInput(missing_tensors_message(target_dir, weight_map, missing, prefix))
    tensors = {}
    for name in names:
        with safe_open(target_dir / weight_map[prefix + name], framework="pt") as f:
            tensors[prefix + name] = f.get_tensor(prefix + name)
    return tensors


def missing_tensors_message(target_dir: Path, weight_map: dict, missing: list[str], prefix: str) -> str:
    """Name the real cause: another prefix (only when a tensor of that name sits under one), or an untied target
    whose files hold no head."""
    wanted = [prefix + name for name in missing]
    for name in missing:
        elsewhere = sorted(key for key in weight_map if key.endswith(name) and key != prefix + name)
        if elsewhere:
            return (f"{target_dir}: the target has no tensor(s) {wanted} but has {elsewhere[0]!r}: set "
                    f"target.weight_prefix to {elsewhere[0][: -len(name)]!r}")
    message = f"{target_dir}: the target has no tensor(s) {wanted}"
    if TARGET_HEAD["lm_head"] in missing:
        message += (" - its config.json does not tie the head to the embedding (tie_word_embeddings is not true), yet "
                    "its safetensors hold no lm_head tensor: the checkpoint is incomplete, or its config.json is not "
                    "the one it was saved with")
    return message


def tied_head(target_dir: Path) -> bool:
    """Whether the target's output head is its input embedding (`tie_word_embeddings` in config.json or its
    text_config)."""
    return read_target_info(target_dir).tie_word_embeddings


def target_head(target_dir: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """{"embed": [V, H], "norm": [H], "lm_head": [V, H]} of the target, as float32; a tied target's head is its
    embedding. A tied target whose files also hold another lm_head is refused: SGLang skips that tensor and serves the
    embedding, transformers (the reference server) keeps it, so the two would serve different targets."""
    tied, head_name = tied_head(target_dir), prefix + TARGET_HEAD["lm_head"]
    keys = list(TARGET_HEAD) if not tied or head_name in target_weight_map(target_dir) else ["embed", "norm"]
    tensors = read_target_tensors(target_dir, [TARGET_HEAD[key] for key in keys], prefix)
    head = {key: tensors[prefix + TARGET_HEAD[key]].float() for key in keys}
    if tied and not torch.equal(head.setdefault("lm_head", head["embed"]), head["embed"]):
        raise UnreadableInput(
            f"{target_dir}: config.json ties the head to the embedding (tie_word_embeddings: true) but the files hold "
            f"a different {head_name}: SGLang would serve the embedding, transformers the stored head. Set "
            "tie_word_embeddings to false if the stored head is the real one, or remove the tensor")
    return head


def target_embedding(target_dir: Path, prefix: str = "") -> torch.Tensor:
    """The target's input embedding [V, H], as float32 (the draft shares it)."""
    name = TARGET_HEAD["embed"]
    return read_target_tensors(target_dir, [name], prefix)[prefix + name].float()


def target_verifier(target_dir: Path, prefix: str = "", name: str | None = None) -> Verifier:
    """The target as the speculators layout names it: `name` (e.g. the hub id it is published under) or its resolved
    directory, its architecture and its embedding (read from the directory)."""
    target_dir = Path(target_dir)
    if not target_dir.is_dir():
        raise UnreadableInput(
            f"{target_dir}: no target model directory here; the speculators layout ships the target's embedding, so "
            "export it where the target's weights are (or leave speculators out of export.layouts)"
        )
    architecture = read_target_info(target_dir).architecture
    embed = read_target_tensors(target_dir, [TARGET_HEAD["embed"]], prefix)[prefix + TARGET_HEAD["embed"]]
    return Verifier(name or str(target_dir.resolve()), [architecture] if architecture else [], embed)
