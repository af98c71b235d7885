"""Training from an earlier draft (`training.init_from`; a retrain starts from production's)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from eagle3.errors import Eagle3Error
from eagle3.formats.checkpoint import load_native
from eagle3.formats.vocab_map import VocabMap, carry_rows
from eagle3.model.draft import Eagle3Draft


def warm_start(model: Eagle3Draft, vocab_map: VocabMap, path: Path, log: Callable[[str], None]) -> None:
    """Load the draft at `path` into `model`. A retrain on new prompts (traffic) counts other tokens, so its vocab map
    may differ: the head's rows follow their target ids, and a target id new to the draft vocabulary keeps the row
    `model` has (the target's own)."""
    previous = load_native(path)
    if previous.config.model_copy(update={"target_family": None}) != model.config.model_copy(update={"target_family": None}):
        raise Eagle3Error(f"cannot warm start from {path}: its architecture differs from draft/target in the config")
    tensors = dict(previous.tensors)
    old_map = VocabMap(tensors.pop("d2t"), tensors.pop("t2d"))
    if old_map.target_vocab_size != vocab_map.target_vocab_size:
        raise Eagle3Error(f"cannot warm start from {path}: its t2d covers {old_map.target_vocab_size} target ids, "
                          f"this run's target has {vocab_map.target_vocab_size}; train from scratch")
    head = model.lm_head.weight.detach().cpu().clone()  # [draft_vocab, H]: the target's rows, per this run's map
    kept = carry_rows(head, tensors.pop("lm_head.weight").cpu(), old_map.target_ids(), vocab_map.target_ids())
    model.load_draft_state({**tensors, "lm_head.weight": head, "d2t": vocab_map.d2t, "t2d": vocab_map.t2d})
    changed = "" if kept == vocab_map.draft_vocab_size else (
        f"; the vocab map changed: {kept} of {vocab_map.draft_vocab_size} head rows carried over by target id, "
        f"{vocab_map.draft_vocab_size - kept} new ones start from the target's head")
    log(f"train: warm start from {path}{changed}")
