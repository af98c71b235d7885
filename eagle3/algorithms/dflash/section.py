"""A DFlash draft's config: its own section (`draft.dflash`) and what a config that trains and serves one must hold
(the resolve step, eagle3.resolve, asks both of the entry; docs/algorithms.md, "DFlash")."""

from __future__ import annotations

from pydantic import Field

from eagle3.algorithms.dflash.contract import (
    dflash_default_layer_ids, dflash_family_problem, dflash_rope_problem, dflash_shape_problem,
)
from eagle3.config.base import Section
from eagle3.config.draft import DraftSection
from eagle3.config.run import TargetSection
from eagle3.config.serving import ServingSection, SweepSection, replay_shape
from eagle3.shape import DraftShape

EAGLE31_SWITCHES = ("fc_norm", "norm_before_fc", "norm_output")  # the draft section's EAGLE 3.1 norms


class DFlashSection(Section):
    """A DFlash (block-diffusion) draft's own fields (docs/algorithms.md, "DFlash"); its layers take the draft
    section's sizes (intermediate_size, heads, rope_theta, rms_norm_eps)."""

    num_layers: int = Field(default=5, gt=0, description="draft decoder layers (SpecForge and z-lab train 5)")
    block_size: int = Field(default=16, ge=2, description="tokens a block holds: the verified token, then "
                            "block_size - 1 mask tokens the draft fills in one forward; SGLang's "
                            "--speculative-num-draft-tokens")
    num_anchors: int = Field(default=512, gt=0, description="blocks trained per sequence, at anchors drawn from the "
                             "generated positions (every one when a sequence has fewer)")
    mask_token_id: int = Field(ge=0, description="the target id fed at a block's unknown positions: an id of the "
                               "target's embedding that it never generates (its tokenizer's mask or pad token, say)")


def default_layer_ids(num_layers: int, draft: DraftSection) -> list[int]:
    """SGLang's DFlash capture without named layers: one target layer per draft layer."""
    try:
        return dflash_default_layer_ids(num_layers, draft.dflash.num_layers)
    except ValueError as err:
        raise ValueError(f"data.aux_layers: {err}") from None


def qwen3_layers_problem(draft: DraftSection) -> str | None:
    """Why the draft section cannot give a backbone of DFlash's Qwen3-style layers (DFlash's, or a kind's built on
    it)."""
    switches = [name for name in EAGLE31_SWITCHES if getattr(draft, name)]
    if draft.attention != "mha" or switches:
        return (f"draft.algorithm {draft.algorithm} has Qwen3-style layers: draft.attention mha, and none of "
                f"{', '.join(['draft.' + n for n in switches]) or 'the EAGLE 3.1 switches'}")
    return None


def config_problem(draft: DraftSection, target: TargetSection, serving: ServingSection | None,
                   sweep: SweepSection) -> str | None:
    """Why a config of these sections cannot train and serve its DFlash draft: Qwen3-style layers; a target family
    SGLang cannot hand the draft its layers; a release that would rotate it with another RoPE base; a mask id outside
    the target's vocabulary; a serving shape or sweep point that is not a chain in blocks no longer than it was
    trained on."""
    if problem := qwen3_layers_problem(draft):
        return problem
    if problem := dflash_family_problem(target.family):
        return f"draft.algorithm dflash with target.family {target.family}: {problem}"
    release = serving.release if serving is not None else None
    if release is not None and (problem := dflash_rope_problem(release, draft.rope_theta)):
        return f"draft.algorithm dflash, serving.release {release}: {problem}"
    mask = draft.dflash.mask_token_id
    if mask >= target.vocab_size:
        return (f"draft.dflash.mask_token_id {mask} is outside the target's vocabulary (0 .. {target.vocab_size - 1}): "
                "SGLang refuses it; pick an id of the target's embedding")
    block = draft.dflash.block_size
    shapes = [("serving", replay_shape(serving))]
    shapes += [(f"sweep.points[{i}]", DraftShape(*point)) for i, point in enumerate(sweep.points)]
    for field, shape in shapes:
        if problem := dflash_shape_problem(block, shape):
            return (f"draft.algorithm dflash, {field}: {problem}; give chains (eagle_topk 1) of up to {block - 1} "
                    f"steps (draft.dflash.block_size {block}){'' if serving else ': add a serving section'}")
    return None
