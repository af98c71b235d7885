"""Where draft weights come from: the target's embedding and head (read tensor by tensor through the
safetensors index, never the whole target), native checkpoints, and served checkpoints read the way
SGLang's loader reads them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3.errors import UnreadableInput
from eagle3.formats import engines
from eagle3.formats.checkpoint import DraftConfig, NativeDraft, Verifier, read_checkpoint, to_native
from eagle3.formats.target import read_target_info
from eagle3.model.draft import Eagle3Draft, init_weights

TARGET_HEAD = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}


def read_target_tensors(target_dir: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read named tensors from a (sharded) safetensors checkpoint through its index."""
    target_dir = Path(target_dir)
    index = target_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        single = target_dir / "model.safetensors"
        with safe_open(single, framework="pt") as f:
            weight_map = {name: single.name for name in f.keys()}
    missing = [name for name in names if name not in weight_map]
    if missing:
        raise UnreadableInput(f"{target_dir}: the target has no tensor(s) {missing} (check target.weight_prefix)")
    tensors = {}
    for name in names:
        with safe_open(target_dir / weight_map[name], framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    return tensors


def target_head(target_dir: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """{"embed": [V, H], "norm": [H], "lm_head": [V, H]} of the target, as float32."""
    tensors = read_target_tensors(target_dir, [prefix + name for name in TARGET_HEAD.values()])
    return {key: tensors[prefix + name].float() for key, name in TARGET_HEAD.items()}


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
    embed = read_target_tensors(target_dir, [prefix + TARGET_HEAD["embed"]])[prefix + TARGET_HEAD["embed"]]
    return Verifier(name or str(target_dir.resolve()), [architecture] if architecture else [], embed)


def draft_from_native(draft: NativeDraft, embed: torch.Tensor) -> Eagle3Draft:
    model = Eagle3Draft(draft.config, embed)
    model.load_draft_state(draft.tensors)
    return model.float()


def draft_as_served(path: Path, release: str | None, embed: torch.Tensor, seed: int = 0) -> Eagle3Draft:
    """A draft loaded the way SGLang's loader for `release` loads it: tensors it would skip keep their
    random initialisation, and d2t is read as offsets (hot_token_id = d2t + arange)."""
    raw = read_checkpoint(Path(path))
    if "d2t" not in raw.tensors:
        raise UnreadableInput(f"{path}: no d2t tensor; SGLang would serve the target's whole vocabulary")
    config = served_config(raw, release)
    model = Eagle3Draft(config, embed)
    init_weights(model, seed)
    rule, _ = engines.loader_rule(release)
    flags = engines.enabled_flags(raw.config)
    state = {}
    for name, tensor in raw.tensors.items():
        canonical = engines.loaded_name(name, rule, flags)
        if canonical is not None and canonical != "t2d":
            state[canonical] = tensor.float() if tensor.is_floating_point() else tensor
    model.load_state_dict(state, strict=False)
    return model.float()


def served_config(raw, release: str | None) -> DraftConfig:
    """The architecture, with the aux layers the target engine captures for these ids on this release
    (not the ones the draft was trained on: a mismatch must show up as low acceptance)."""
    config_only = replace(raw, tensors={"d2t": raw.tensors["d2t"]})  # tensors load under the loader's rules
    config = to_native(config_only, release=release).config
    if raw.layout != "sglang":
        return config
    # A switch the release does not implement is not built: its tensors are dropped with the rest.
    rule, _ = engines.loader_rule(release)
    config = config.model_copy(update={flag: False for flag in config.flags() if flag not in rule.flags})
    ids = (raw.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    capture = engines.sglang_capture(ids, config.target_family, release, config.target_num_hidden_layers)
    if capture.status != "known":
        raise UnreadableInput(f"{raw.path}: cannot tell which layers SGLang captures: {capture.explanation}")
    if len(capture.layers) != len(config.aux_layers):
        raise UnreadableInput(
            f"{raw.path}: SGLang captures {len(capture.layers)} aux states ({capture.explanation}) but fc expects "
            f"{len(config.aux_layers)}; `eagle3 validate` names the cause"
        )
    return config.model_copy(update={"aux_layers": list(capture.layers)})
