"""An EAGLE-3 draft trained from an earlier one (`training.init_from`; a retrain starts from production's), loaded
from the resolved copy (eagle3.algorithms.init_copy). What may differ between the init draft and this run's draft
(docs/training.md): the draft vocabulary (the head's rows follow their target ids) and the metadata the config sets anew; a difference in
shape or in what the weights compute is refused, naming the tensor or the field with both values.
"""

from __future__ import annotations

from typing import Callable

from eagle3.algorithms.init_copy import ResolvedInit, carried_config_problem
from eagle3.errors import Eagle3Error
from eagle3.algorithms.eagle3.checkpoint import DraftConfig, expected_shapes, load_native
from eagle3.draft.vocab_map import VocabMap, carry_rows
from eagle3.algorithms.eagle3.model import Eagle3Draft

VOCAB_TENSORS = ("d2t", "t2d")  # this run's vocab map, never the init draft's
# Fields this run's config sets anew: what a draft was stored in, which family it names, how far serving may go, how
# many head rows it has (they follow their target ids). Everything else in DraftConfig must agree.
SET_ANEW = ("format", "format_version", "torch_dtype", "target_family", "max_position_embeddings", "draft_vocab_size")
# Numerical details trained on with this config's value, a difference named in the log
NOTED = ("rms_norm_eps",)


def warm_start(model: Eagle3Draft, vocab_map: VocabMap, init: ResolvedInit, log: Callable[[str], None]) -> None:
    """Load the init draft into `model`. A retrain on new prompts (traffic) counts other tokens, so its vocab map
    may differ: the head's rows follow their target ids, and a target id new to the draft vocabulary keeps the row
    `model` has (the target's own)."""
    previous = load_native(init.path)
    problem = carry_over_problem(previous.config, model.config)
    if problem:
        raise Eagle3Error(f"cannot warm start from training.init_from {init.describe()}: {problem}")
    noted = [f"{field} {getattr(previous.config, field)} -> {getattr(model.config, field)}" for field in NOTED
             if getattr(previous.config, field) != getattr(model.config, field)]
    tensors = {name: t for name, t in previous.tensors.items() if name not in VOCAB_TENSORS}
    old_map = VocabMap(previous.tensors["d2t"], previous.tensors["t2d"])
    head = model.lm_head.weight.detach().cpu().clone()  # [draft_vocab, H]: the target's rows, per this run's map
    kept = carry_rows(head, tensors.pop("lm_head.weight").cpu(), old_map.target_ids(), vocab_map.target_ids())
    model.load_draft_state({**tensors, "lm_head.weight": head, "d2t": vocab_map.d2t, "t2d": vocab_map.t2d})
    changed = "" if kept == vocab_map.draft_vocab_size else (
        f"; the vocab map changed: {kept} of {vocab_map.draft_vocab_size} head rows carried over by target id, "
        f"{vocab_map.draft_vocab_size - kept} new ones start from the target's head")
    trained_with = f"; trained with this config's {', '.join(noted)}" if noted else ""
    log(f"train: warm start from {init.describe()}{changed}{trained_with}")


def carry_over_problem(init: DraftConfig, ours: DraftConfig) -> str | None:
    """Why the init draft's weights cannot start this run's draft: the first tensor whose shape differs (the head's
    rows apart), then the first field that changes what the same weights compute; None when they carry over."""
    init_shapes, our_shapes = expected_shapes(init), expected_shapes(ours)
    for name in [*our_shapes, *(name for name in init_shapes if name not in our_shapes)]:
        theirs, mine = init_shapes.get(name), our_shapes.get(name)
        if name in VOCAB_TENSORS or (name == "lm_head.weight" and theirs[1:] == mine[1:]):
            continue  # the draft vocabulary may differ: rows follow their target ids
        if theirs != mine:
            return (f"{name} {shape_text(theirs)} in the init draft, {shape_text(mine)} in this config; make the "
                    "draft section and the target match the init draft's architecture, or train from scratch "
                    "(no training.init_from)")
    return carried_config_problem(init, ours, SET_ANEW + NOTED)


def shape_text(shape: tuple[int, ...] | None) -> str:
    return "absent" if shape is None else str(list(shape))
