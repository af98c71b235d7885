"""What the pipeline needs to know about a target model, read from its config.json alone."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import UnreadableInput
from eagle3.formats.engines import ARCHITECTURE_FAMILY
from eagle3.fsutil import read_json


@dataclass(frozen=True)
class TargetInfo:
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    family: str | None  # the SGLang model file, None when the architecture is not in our table
    architecture: str | None
    rms_norm_eps: float


def read_target_info(path: Path) -> TargetInfo:
    """Read a target directory's (or file's) config.json; multimodal configs nest it in text_config."""
    path = Path(path)
    config_path = path / "config.json" if path.is_dir() else path
    config = read_json(config_path, "no such file (expected the target's config.json)")
    if not isinstance(config, dict) or not isinstance(config.get("text_config", {}), dict):
        raise UnreadableInput(f"{config_path}: expected a JSON object (with an optional text_config object)")
    architectures = config.get("architectures") or [None]
    text = config.get("text_config") or config
    missing = [key for key in ("num_hidden_layers", "hidden_size", "vocab_size") if key not in text]
    if missing:
        raise UnreadableInput(f"{config_path}: target config lacks {', '.join(missing)}")
    return TargetInfo(
        num_hidden_layers=int(text["num_hidden_layers"]),
        hidden_size=int(text["hidden_size"]),
        vocab_size=int(text["vocab_size"]),
        family=ARCHITECTURE_FAMILY.get(architectures[0]),
        architecture=architectures[0],
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
    )
