"""A DSpark draft's config: its own section (`draft.dspark`) and what a config that trains and serves one must hold
(the resolve step, eagle3.resolve, asks both of the entry; docs/algorithms.md, "DSpark")."""

from __future__ import annotations

from pydantic import Field

from eagle3.algorithms.dflash.contract import dflash_default_layer_ids
from eagle3.algorithms.dflash.section import qwen3_layers_problem
from eagle3.algorithms.dspark.contract import dspark_family_problem, dspark_release_problem, dspark_shape_problem
from eagle3.algorithms.dspark.model import MarkovHeadType
from eagle3.config.base import Section
from eagle3.config.draft import DraftSection
from eagle3.config.run import TargetSection
from eagle3.config.serving import ServingSection, SweepSection, replay_shape
from eagle3.shape import DraftShape


class DSparkSection(Section):
    """A DSpark draft's own fields (docs/algorithms.md, "DSpark"); its layers take the draft section's sizes
    (intermediate_size, heads, rope_theta, rms_norm_eps), as DFlash's do."""

    num_layers: int = Field(default=3, gt=0, description="backbone decoder layers (Inferact's Kimi-K3 DSpark has 3; "
                            "the paper's 2-layer DSpark beats a 5-layer DFlash)")
    block_size: int = Field(default=7, ge=1, description="gamma: the block's entries, each drafting one token "
                            "(SGLang's default 7); served with --speculative-num-draft-tokens gamma + 1")
    num_anchors: int = Field(default=512, gt=0, description="blocks trained per sequence, at anchors drawn from the "
                             "generated positions (every one when a sequence has fewer)")
    mask_token_id: int = Field(ge=0, description="the target id fed at a block's unknown entries: an id of the "
                               "target's embedding that it never generates")
    markov_rank: int = Field(default=256, gt=0, description="r of the Markov head: markov_w1 [V, r] and markov_w2 "
                             "[V, r], two vocab x rank tables")
    markov_head: MarkovHeadType = Field(default="vanilla", description="vanilla (the paper's and vLLM's), gated or "
                                        "rnn (SGLang serves all three)")
    confidence_head: bool = Field(default=True, description="train the confidence head SGLang's ragged verify reads")
    confidence_head_with_markov: bool = Field(default=True, description="the confidence head reads the previous "
                                              "token's markov_w1 row too (SGLang's default)")
    ce_weight: float = Field(default=0.1, ge=0, description="the soft cross-entropy's weight (SpecForge's 0.1)")
    l1_weight: float = Field(default=0.9, ge=0, description="sum |p - q|'s weight, twice the total variation "
                             "(SpecForge's 0.9)")
    confidence_weight: float = Field(default=1.0, ge=0, description="the confidence BCE's weight (SpecForge's 1.0)")


def default_layer_ids(num_layers: int, draft: DraftSection) -> list[int]:
    """SGLang's default without named layers: DFlash's spread, one target layer per backbone layer."""
    try:
        return dflash_default_layer_ids(num_layers, draft.dspark.num_layers)
    except ValueError as err:
        raise ValueError(f"data.aux_layers: {err}") from None


def config_problem(draft: DraftSection, target: TargetSection, serving: ServingSection | None,
                   sweep: SweepSection) -> str | None:
    """Why a config of these sections cannot train and serve its DSpark draft: Qwen3-style layers; a release without
    DSPARK; a family SGLang cannot hand the draft its layers; a mask id outside the vocabulary; a serving shape or
    sweep point that is not the chain of gamma drafts SGLang serves."""
    if problem := qwen3_layers_problem(draft):
        return problem
    release = serving.release if serving is not None else None
    if problem := dspark_release_problem(release):
        return f"draft.algorithm dspark, serving.release {release}: {problem}"
    if problem := dspark_family_problem(target.family):
        return f"draft.algorithm dspark with target.family {target.family}: {problem}"
    spark = draft.dspark
    if spark.mask_token_id >= target.vocab_size:
        return (f"draft.dspark.mask_token_id {spark.mask_token_id} is outside the target's vocabulary (0 .. "
                f"{target.vocab_size - 1}): SGLang refuses it; pick an id of the target's embedding")
    shapes = [("serving", replay_shape(serving))]
    shapes += [(f"sweep.points[{i}]", DraftShape(*point)) for i, point in enumerate(sweep.points)]
    for field, shape in shapes:
        if problem := dspark_shape_problem(spark.block_size, shape):
            return (f"draft.algorithm dspark, {field}: {problem}; give chains (eagle_topk 1) of "
                    f"{spark.block_size} steps (draft.dspark.block_size){'' if serving else ': add a serving section'}")
    return None
