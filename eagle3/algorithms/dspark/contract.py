"""What SGLang does with a DSpark draft, read from each release's own code (tests/conformance/test_dspark*.py runs it;
docs/algorithms.md, "DSpark")."""

from __future__ import annotations

from eagle3.contract.releases import ReleaseRange, parse_release
from eagle3.shape import DraftShape

# The releases whose srt/models/dspark.py and SpeculativeAlgorithm.DSPARK exist (0.5.11-0.5.13 have neither); from
# the first, Qwen3DSparkModel is an entry class in every one.
DSPARK_RELEASES = ReleaseRange("0.5.16", "0.5.23")
ARCHITECTURE = "Qwen3DSparkModel"
# The families a DSpark draft reads the target's layers on: the DSPARK worker asks the target for them as DFLASH's
# does (set_dflash_layers_to_capture, id k = the output of decoder layer k) on these.
DSPARK_FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v2", "kimi_k25", "glm4_moe_lite", "gpt_oss")


def dspark_release_problem(release: str | None) -> str | None:
    """Why SGLang `release` cannot serve a DSpark draft (None: it can, or the release is not named)."""
    if release is None or parse_release(release) in DSPARK_RELEASES:
        return None
    return (f"SGLang {release} has no DSPARK speculative algorithm (no srt/models/dspark.py; it came in 0.5.16): serve "
            f"with SGLang {DSPARK_RELEASES}")


def dspark_family_problem(family: str) -> str | None:
    if family in DSPARK_FAMILIES:
        return None
    return (f"SGLang's {family} model cannot hand a DSpark draft its target's layers in any release "
            f"{DSPARK_RELEASES} (DSpark targets: {', '.join(DSPARK_FAMILIES)})")


def dspark_shape_problem(gamma: int | None, shape: DraftShape) -> str | None:
    """Why a DSpark draft of `gamma` (its config's block_size) cannot be served in `shape` (None: it can). SGLang's
    DSPARK worker drafts one chain of gamma tokens a step, verified in a window of gamma + 1: its ServerArgs refuse a
    --speculative-num-draft-tokens other than the checkpoint's gamma + 1 (0.5.16-0.5.23)."""
    if shape.eagle_topk != 1:
        return f"a DSpark draft proposes one chain a step, not the tree of {shape.label()}: eagle_topk must be 1"
    if shape.num_draft_tokens != shape.num_steps + 1:
        return (f"{shape.label()}: SGLang's DSPARK worker verifies num_steps + 1 tokens a step (the chain and its "
                "anchor), so num_draft_tokens must be num_steps + 1")
    if gamma is not None and shape.num_steps != gamma:
        return (f"{shape.label()} drafts {shape.num_steps} tokens a step, but the draft's block is {gamma} "
                f"(block_size): "
                f"SGLang refuses --speculative-num-draft-tokens other than {gamma + 1}; serve num_steps {gamma}")
    return None
