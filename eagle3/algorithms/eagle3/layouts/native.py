"""The native layout: what our trainer writes. Tensors carry the canonical (`midlayer.*`) names; config.json is
DraftConfig itself: the architecture plus the aux layers the training data were captured at, in our convention
(id k = output of decoder layer k)."""

from __future__ import annotations

import eagle3.algorithms.eagle3.contract as loader
from eagle3.algorithms.eagle3.layouts.shared import (
    DraftConfig, Log, NATIVE_FORMAT, RawCheckpoint, canonical_with_layer_at, names_with_layer_at,
)
from eagle3.config.draft import MLA_SIZES
from eagle3.draft.files import Verifier


def detects(config: dict) -> bool:
    return config.get("format") == NATIVE_FORMAT


def tensor_names(names: list[str] = ()) -> dict[str, str]:
    return names_with_layer_at(loader.CANONICAL_LAYER_PREFIX, names)


def canonical_name(name: str, config: dict) -> str | None:
    return canonical_with_layer_at(loader.CANONICAL_LAYER_PREFIX, name)


def decode_config(raw: RawCheckpoint, family: str | None, release: str | None, num_layers: int | None,
                  log: Log) -> dict:
    """The config as written: it names the target itself, so nothing the caller knows is needed."""
    return raw.config


def encode_config(cfg: DraftConfig, release: str | None, num_steps: int, verifier: Verifier | None) -> dict:
    if cfg.attention == "mla":
        return cfg.model_dump()
    return cfg.model_dump(exclude={"attention", "rope_interleave", *MLA_SIZES})  # a Llama-layer draft as before them


def verifier_tensors(cfg: DraftConfig, verifier: Verifier) -> dict:
    return {}  # the trainer reads the target's embedding from the target itself
