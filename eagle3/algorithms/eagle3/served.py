"""An EAGLE-3 draft's weights as a server holds them: a native checkpoint, or an export read the way SGLang's loader
for a release reads it (what it skips keeps its random init; the aux layers are the ones the engine captures)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from eagle3.algorithms.eagle3.model import Eagle3Draft
from eagle3.contract import engines
import eagle3.algorithms.eagle3.contract as loader
from eagle3.algorithms.eagle3.checkpoint import DraftConfig, NativeDraft, read_checkpoint, to_native
from eagle3.errors import UnreadableInput
from eagle3.model.blocks import init_weights


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
    rule = loader.draft_loader_rule(config.attention, release)
    flags = loader.enabled_flags(raw.config)
    state = {}
    for name, tensor in raw.tensors.items():
        canonical = loader.loaded_name(name, rule, flags)
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
    rule = loader.draft_loader_rule(config.attention, release)
    if rule is None:
        raise UnreadableInput(f"{raw.path}: {loader.served_draft_problem(config.attention, [], release)}")
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
