"""What SGLang does with a DFlash draft's target layers, read from each release's own code (0.5.11-0.5.23;
tests/conformance/test_dflash.py runs it, docs/algorithms.md states it)."""

from __future__ import annotations

from eagle3.contract.releases import ReleaseRange, parse_release
from eagle3.shape import DraftShape

# The families whose model has set_dflash_layers_to_capture in every supported release. Each records, for target
# layer id k, the output of decoder layer k (our numbering, no shift rule unlike EAGLE-3's aux ids); the others
# (qwen2, gemma3) cannot feed a DFlash draft at all.
DFLASH_FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v2", "kimi_k25", "glm4_moe_lite", "gpt_oss")


# DFlashAttention of 0.5.11-0.5.12 reads `config.rope_theta`, defaulting to 1,000,000; under their transformers pin
# (5.6.0) a Qwen3 config keeps its base in rope_parameters only, so every DFlash draft rotates with 1,000,000 there.
# From 0.5.13 the base comes from get_rope_config (rope_parameters first): the draft's own.
FIXED_ROPE_RELEASES = ReleaseRange("0.5.11", "0.5.12")
FIXED_ROPE_THETA = 1_000_000.0


def dflash_rope_problem(release: str | None, rope_theta: float) -> str | None:
    """Why `release` would serve a DFlash draft trained with RoPE base `rope_theta` with another one (None when it
    serves the draft's own; a release not named is judged on 0.5.11-0.5.12 too)."""
    if rope_theta == FIXED_ROPE_THETA or (release is not None and parse_release(release) not in FIXED_ROPE_RELEASES):
        return None
    which = f"SGLang {release}" if release is not None else f"SGLang {FIXED_ROPE_RELEASES} (the release is not named)"
    return (f"{which} rotates every DFlash draft with RoPE base {FIXED_ROPE_THETA:,.0f} (it reads config.rope_theta, "
            f"which its transformers no longer sets), not the trained {rope_theta:,.0f}: serve with SGLang >= 0.5.13 "
            f"and name it in serving.release, or train with draft.rope_theta {FIXED_ROPE_THETA:.0f}")


def dflash_family_problem(family: str) -> str | None:
    """Why SGLang cannot serve a DFlash draft of a `family` target (None when every supported release can)."""
    if family in DFLASH_FAMILIES:
        return None
    return (f"SGLang's {family} model has no set_dflash_layers_to_capture in any release 0.5.11-0.5.23: it cannot "
            f"hand a DFlash draft its target's layers (DFlash targets: {', '.join(DFLASH_FAMILIES)})")


def dflash_default_layer_ids(num_layers: int, draft_layers: int) -> list[int]:
    """The target layers (our numbering: id k = output of layer k) a DFlash draft reads when its config names none:
    SGLang's `build_target_layer_ids` (dflash_utils.py, 0.5.11-0.5.23), one per draft layer spread evenly over
    1 .. num_layers - 3 (rounding half to even, as Python's round), or the middle layer for a one-layer draft."""
    if draft_layers == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    if end < start:
        raise ValueError(f"SGLang's default DFlash target layers need a target of at least 4 layers, not {num_layers}: "
                         "name them in data.aux_layers")
    return [int(round(start + i * (end - start) / (draft_layers - 1))) for i in range(draft_layers)]


def dflash_shape_problem(block_size: int | None, shape: DraftShape) -> str | None:
    """Why a DFlash draft trained on blocks of `block_size` cannot be served in `shape` (None: it can). SGLang's DFLASH
    worker verifies one chain a step, in blocks of --speculative-num-draft-tokens whatever the draft's block_size (it
    only warns): a longer block puts mask tokens at offsets the draft never learnt; a shorter one is a chain it can
    draft (each entry sees the block's others, so it drafts as a smaller block, not as the first entries of its own)."""
    if shape.eagle_topk != 1:
        return f"a DFlash draft proposes one chain a step, not the tree of {shape.label()}: eagle_topk must be 1"
    if block_size is not None and shape.num_draft_tokens > block_size:
        return (f"{shape.label()} verifies blocks of {shape.num_draft_tokens} tokens (--speculative-num-draft-tokens), "
                f"but the draft was trained on blocks of {block_size} (block_size): num_steps must be at most "
                f"{block_size - 1}")
    return None
