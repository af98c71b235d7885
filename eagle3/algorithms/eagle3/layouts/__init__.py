"""One adapter per draft layout (docs/contracts.md), each owning its tensor names and its config.json, both ways:
`native` (what our trainer writes), `sglang` (LlamaForCausalLMEagle3) and `speculators` (vLLM). Reading,
checking and converting between them is eagle3/algorithms/eagle3/checkpoint.py's, through LAYOUTS."""

from __future__ import annotations

from typing import Protocol

import torch

from eagle3.algorithms.eagle3.layouts import native, sglang, speculators
from eagle3.algorithms.eagle3.layouts.shared import DraftConfig, Log, RawCheckpoint
from eagle3.draft.files import Verifier


class LayoutAdapter(Protocol):
    """What a layout module provides (the modules themselves are the adapters)."""

    def detects(self, config: dict) -> bool:
        """Whether a config.json is in this layout."""

    def tensor_names(self, names: list[str] = ()) -> dict[str, str]:
        """canonical -> this layout's name, for the fixed tensors and the switch tensors among `names`."""

    def canonical_name(self, name: str, config: dict) -> str | None:
        """The canonical name of one of this layout's tensors; None when the tensor has no place in it."""

    def decode_config(self, raw: RawCheckpoint, family: str | None, release: str | None, num_layers: int | None,
                      log: Log) -> dict:
        """DraftConfig's fields from the checkpoint's config.json, read for the target family, SGLang release and
        target layer count the caller knows (None: not known)."""

    def encode_config(self, cfg: DraftConfig, release: str | None, num_steps: int, verifier: Verifier | None) -> dict:
        """This layout's config.json for a checked draft, for an SGLang release, served with `num_steps` drafting
        steps per verify step, for the target `verifier` (None: not known)."""

    def verifier_tensors(self, cfg: DraftConfig, verifier: Verifier) -> dict[str, torch.Tensor]:
        """The target's tensors this layout ships beside the draft's own, under its names (after encode_config
        accepted the verifier)."""


LAYOUTS: dict[str, LayoutAdapter] = {"native": native, "sglang": sglang, "speculators": speculators}
