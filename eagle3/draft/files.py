"""What every kind of draft on disk shares: its directory's file names, and the target a layout that names one is
exported for (speculators' verifier)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def is_checkpoint_file(name: str) -> bool:
    """Whether a draft reader reads a file of this name in a checkpoint's directory: what a draft's content is."""
    return name == CONFIG_FILE or name.endswith(".safetensors")


@dataclass(frozen=True)
class Verifier:
    """The target a draft is exported for, as a layout that names it needs it (speculators: the verifier its loader
    reads, and the target's embedding shipped beside the draft's own weights)."""

    name_or_path: str  # a hub id, or a directory where the export is loaded
    architectures: list[str]  # the target's config.json architectures
    embed_tokens: torch.Tensor  # [vocab, hidden], the target's own
