"""DFlash's target layer ids against each release's own code (inside/dflash.py): the ids a draft that names none
reads (`build_target_layer_ids`), and for every family the state each named id makes the capture loop record. Our
convention (id k = output of decoder layer k, what data.aux_layers captures for training) must be what the release
hands a DFlash draft: an id off by one here is a draft served other features than it was trained on."""

from __future__ import annotations

import pytest

from eagle3.algorithms.dflash.contract import DFLASH_FAMILIES, dflash_default_layer_ids
from releases import RELEASES

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3", "deepseek_v2", "kimi_k25", "glm4_moe_lite", "gpt_oss")
DEFAULTS = [(61, 5), (36, 5), (28, 3), (8, 2), (36, 1), (3, 2)]
IDS = {61: [[1, 15, 30, 44, 58], [0, 30, 59], [2, 30, 58]], 8: [[0, 1, 2], [1, 3, 5]]}
CASES = [{"family": family, "num_layers": n, "ids": ids, "first_k_dense_replace": 1}
         for family in FAMILIES for n, lists in IDS.items() for ids in lists]


@pytest.fixture(scope="module", params=RELEASES)
def probed(request, run_sglang):
    answer = run_sglang(request.param, "dflash", {"defaults": DEFAULTS, "cases": CASES})
    return request.param, answer


def test_a_draft_without_ids_reads_the_layers_the_release_spreads(probed):
    release, answer = probed
    for case in answer["defaults"]:
        n, layers = case["num_layers"], case["draft_layers"]
        if isinstance(case["ids"], dict):  # the release refuses the target (fewer than 4 layers)
            with pytest.raises(ValueError):
                dflash_default_layer_ids(n, layers)
            continue
        assert dflash_default_layer_ids(n, layers) == case["ids"], f"SGLang {release}, {n} layers, {layers} drafted"


@pytest.mark.parametrize("family", FAMILIES)
def test_each_named_id_makes_the_release_record_the_output_of_that_layer(probed, family):
    release, answer = probed
    cases = [case for case in answer["cases"] if case["family"] == family]
    if all("skipped" in case for case in cases):
        assert family not in DFLASH_FAMILIES, f"SGLang {release}: {cases[0]['skipped']}"
        pytest.skip(f"SGLang {release}: {cases[0]['skipped']} (configs are refused: eagle3.algorithms.dflash.contract)")
    assert family in DFLASH_FAMILIES, f"SGLang {release} captures {family}'s layers for DFlash: add it to the table"
    for case in cases:
        assert "set_error" not in case, f"SGLang {release} refuses {family} ids {case['ids']}: {case['set_error']}"
        loop = case["capture_loop"]
        assert "error" not in loop, f"SGLang {release} {family} {case['ids']}: {loop['error']}"
        assert [b - 1 for b in loop["captured"]] == case["ids"], (
            f"SGLang {release} {family} records boundaries {loop['captured']} for DFlash ids {case['ids']} "
            f"(layers_to_capture {case['layers_to_capture']})")
