"""DFlash's target layer ids against each release's own code (inside/dflash.py): the ids a draft that names none
reads (`build_target_layer_ids`), and for every family the state each named id makes the capture loop record. Our
convention (id k = output of decoder layer k, what data.aux_layers captures for training) must be what the release
hands a DFlash draft: an id off by one here is a draft served other features than it was trained on.

The same cases through the dispatch each release's model runner calls for a DSPARK draft (from 0.5.16) say
DSpark's contract (eagle3.algorithms.dspark.contract): its drafts read the same layers, the same way."""

from __future__ import annotations

import pytest

from eagle3.algorithms.dflash.contract import DFLASH_FAMILIES, dflash_default_layer_ids
from eagle3.algorithms.dspark.contract import DSPARK_FAMILIES
from releases import DSPARK_RELEASES, RELEASES

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3", "deepseek_v2", "kimi_k25", "glm4_moe_lite", "gpt_oss")
DEFAULTS = [(61, 5), (36, 5), (28, 3), (8, 2), (36, 1), (3, 2)]
IDS = {61: [[1, 15, 30, 44, 58], [0, 30, 59], [2, 30, 58]], 8: [[0, 1, 2], [1, 3, 5]]}
CASES = [{"family": family, "num_layers": n, "ids": ids, "first_k_dense_replace": 1}
         for family in FAMILIES for n, lists in IDS.items() for ids in lists]


@pytest.fixture(scope="module", params=RELEASES)
def probed(request, run_sglang):
    answer = run_sglang(request.param, "dflash", {"defaults": DEFAULTS, "cases": CASES, "dspark": True})
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


@pytest.mark.parametrize("family", FAMILIES)
def test_a_dspark_draft_reads_the_layers_a_dflash_draft_reads(probed, family):
    """From 0.5.16 the model runner sets a DSPARK target's capture with configure_aux_hidden_state_capture(is_dspark=
    True): set_dspark_layers_to_capture where the target defines it (none of these families does, in any release),
    else set_dflash_layers_to_capture. So on each family of DSPARK_FAMILIES id k records the output of layer k, as for
    DFlash; on the others the release refuses the target. Releases without DSPARK have no such dispatch."""
    release, answer = probed
    cases = [case for case in answer["cases"] if case["family"] == family]
    if release not in DSPARK_RELEASES:
        assert all("no DSPARK capture dispatch" in case["dspark"].get("skipped", "") for case in cases), (
            f"SGLang {release} has a DSPARK capture dispatch")
        return
    for case in cases:
        dspark = case["dspark"]
        if "skipped" in dspark or "set_error" in dspark:
            assert family not in DSPARK_FAMILIES, f"SGLang {release} cannot capture {family} for DSpark: {dspark}"
            continue
        assert family in DSPARK_FAMILIES, f"SGLang {release} captures {family}'s layers for DSpark: add it to the table"
        assert not dspark["has_set_dspark_layers_to_capture"], (
            f"SGLang {release}'s {family} defines set_dspark_layers_to_capture: read it and say what DSpark captures")
        assert dspark["layers_to_capture"] == case["layers_to_capture"], f"SGLang {release} {family}: not DFlash's"
        loop = dspark["capture_loop"]
        assert "error" not in loop, f"SGLang {release} {family} {case['ids']}: {loop['error']}"
        assert [b - 1 for b in loop["captured"]] == case["ids"], (
            f"SGLang {release} {family} records boundaries {loop['captured']} for DSpark ids {case['ids']}")
