"""What SGLang does with a DFlash draft's target layers, read from each release's own code (0.5.11-0.5.23;
tests/conformance/test_dflash.py runs it, docs/algorithms.md states it)."""

from __future__ import annotations

# The families whose model has set_dflash_layers_to_capture in every supported release. Each records, for target
# layer id k, the output of decoder layer k (our numbering, no shift rule unlike EAGLE-3's aux ids); the others
# (qwen2, gemma3) cannot feed a DFlash draft at all.
DFLASH_FAMILIES = ("llama", "qwen3", "qwen3_moe", "deepseek_v2", "kimi_k25", "glm4_moe_lite", "gpt_oss")


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
