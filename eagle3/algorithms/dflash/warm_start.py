"""A DFlash draft trained from an earlier one (`training.init_from`; a retrain starts from production's), loaded from
the resolved copy (eagle3.algorithms.init_copy). The draft has no head or embedding of its own (the target's are used)
and its loss scores the run's vocab map, so a changed draft vocabulary carries over as it is; what changes the shapes
or what the same weights compute is refused, naming the field with both values (docs/training.md, "Warm starts")."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from eagle3.algorithms.dflash.layout import native_config
from eagle3.algorithms.dflash.model import DFlashConfig, DFlashDraft
from eagle3.algorithms.init_copy import ResolvedInit, carried_config_problem
from eagle3.draft.files import CONFIG_FILE, WEIGHTS_FILE
from eagle3.errors import Eagle3Error
from eagle3.fsutil import atomic_directory
from eagle3.records.manifest import write_manifest

Log = Callable[[str], None]
# Fields this run's config sets anew: what the draft is stored in, the family it names, how far serving may go, the
# rows its loss scores (the run's vocab map). Everything else in DFlashConfig must agree.
SET_ANEW = ("format", "format_version", "torch_dtype", "target_family", "max_position_embeddings", "draft_vocab_size")
# Trained on with this config's value, a difference named in the log: the same weights fill a block of any size (a
# server may draft shorter blocks than trained), and the norms' epsilon is a numerical detail
NOTED = ("block_size", "rms_norm_eps")


def write_copy(source: Path, out: Path, source_name: str, config_type: type[DFlashConfig] = DFlashConfig) -> None:
    """The draft of `config_type` (DFlash's, or a kind built on its backbone) at `source` (a native draft, or an SGLang
    export this project wrote: every registry version holds one) as a native draft at `out`, replaced whole."""
    cfg = native_config(source, config_type)
    tensors = load_file(source / WEIGHTS_FILE)
    with atomic_directory(out, overwrite=True) as tmp:
        save_file({name: t.float().contiguous() for name, t in tensors.items()}, tmp / WEIGHTS_FILE,
                  metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(cfg.model_dump_json(indent=2))
        write_manifest(tmp, kind=f"draft-{cfg.format}", fields={"layout": cfg.format, "source": source_name})


def warm_start(model: DFlashDraft, init: ResolvedInit, log: Log, noted: tuple[str, ...] = NOTED) -> None:
    """Load the init draft's weights into `model` (seeded, on its device; DFlash's, or a kind built on its backbone,
    whose `noted` fields may differ too), refused when they cannot carry over."""
    previous = native_config(init.path, type(model.config))
    if problem := carried_config_problem(previous, model.config, SET_ANEW + noted):
        raise Eagle3Error(f"cannot warm start from training.init_from {init.describe()}: {problem}")
    with torch.no_grad():
        model.load_draft_state(load_file(init.path / WEIGHTS_FILE))
    changed = [f"{field} {getattr(previous, field)} -> {getattr(model.config, field)}" for field in noted
               if getattr(previous, field) != getattr(model.config, field)]
    log(f"train: warm start from {init.describe()}"
        + (f"; trained with this config's {', '.join(changed)}" if changed else ""))


def carry_over_problem(init: DFlashConfig, ours: DFlashConfig) -> str | None:
    """Why the init draft's weights cannot start this run's draft (the first field that differs and is not set anew or
    noted), or None."""
    return carried_config_problem(init, ours, SET_ANEW + NOTED)
