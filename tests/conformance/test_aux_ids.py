"""Every family x release x ids case of the aux-id table against the release's own
`set_eagle3_layers_to_capture` and capture loop (inside/aux_ids.py)."""

from __future__ import annotations

import pytest

from eagle3.contract import engines
from eagle3.contract.releases import parse_release
from inside.aux_ids import LAYER_HIDDEN  # what a recording layer returns as its hidden_states beside the residual
from releases import RELEASES

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3", "deepseek_v2", "kimi_k25", "glm4_moe_lite", "gpt_oss")
IDS = {
    61: [None, [0, 1, 2], [1, 29, 57], [2, 30, 58], [0, 30, 59], [1, 30, 60], [1, 30, 61], [2, 30, 61]],
    4: [None, [0, 1, 2], [1, 2, 3], [0, 2, 3], [2, 3], [1, 2, 4]],
}
# Kimi-K2.5 and DeepSeek-V3 keep their first layer dense; the overlap path starts after it.
FIRST_K_DENSE = 1
CASES = [{"family": family, "num_layers": n, "ids": ids, "first_k_dense_replace": FIRST_K_DENSE}
         for family in FAMILIES for n, id_lists in IDS.items() for ids in id_lists]


@pytest.fixture(scope="module", params=RELEASES)
def probed(request, run_sglang):
    answer = run_sglang(request.param, "aux_ids", {"cases": CASES})
    return request.param, {(c["family"], c["num_layers"], repr(c["ids"])): c for c in answer["cases"]}, answer


def case_id(case):
    return f"{case['family']}-{case['num_layers']}-{case['ids']}"


def expected_states(ids):
    return len(ids) if ids is not None else 3


def probed_case(probed, case):
    """The release's answer for the case, and ours; a release without the family's capture must be unknown to us."""
    release, answers, _ = probed
    answer = answers[(case["family"], case["num_layers"], repr(case["ids"]))]
    ours = engines.sglang_capture(case["ids"], case["family"], release, case["num_layers"])
    if "skipped" in answer:  # e.g. Gemma 3 before 0.5.12: no set_eagle3_layers_to_capture
        assert engines.aux_id_rule(case["family"], parse_release(release)) is None, answer["skipped"]
        assert ours.status == "unknown" and release in ours.explanation
        pytest.skip(f"SGLang {release}: {answer['skipped']} (the table has no row: configs are refused)")
    return release, answer, ours


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_table_sets_the_layers_the_release_sets(probed, case):
    release, answer, ours = probed_case(probed, case)
    rule = engines.aux_id_rule(case["family"], parse_release(release))
    assert rule is not None, f"{case['family']} on {release} is not in the aux-id table"
    if "set_error" in answer:  # the release refuses the ids at load (Qwen3-MoE's marks on a layer past the last)
        assert ours.lost_ids, f"SGLang {release} refuses ids {case['ids']} ({answer['set_error']}); ours: {ours}"
        return
    inputs = engines.captured_inputs(case["ids"], rule, case["num_layers"])
    assert list(answer["layers_to_capture"]) == inputs, f"SGLang {release} sets {answer['layers_to_capture']}, ours {inputs}"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_what_the_loop_captures_is_what_validate_is_told(probed, case):
    """Where the release's loop hands the draft every state, ours names the same layers; where it hands
    fewer (or fails), ours reports a capture validate rejects; where it records another state than the residual
    stream, the table's row says so and configs trained on transformers' features are refused."""
    release, answer, ours = probed_case(probed, case)
    if "set_error" in answer:
        return  # the test above: a load-time refusal
    loop = answer["capture_loop"]
    assert ours.status == "known", ours.explanation
    rule = engines.aux_id_rule(case["family"], parse_release(release))
    branch_only = bool(loop.get("captured")) and all(v == LAYER_HIDDEN for v in loop["captured"])
    assert (rule.records == engines.BRANCH_ONLY) == branch_only, f"SGLang {release} records {loop}; ours: {rule.records}"
    assert (engines.served_features_problem(case["family"], release) is not None) == branch_only
    if branch_only:
        return
    rejected = bool(ours.lost_ids) or -1 in ours.layers or len(ours.layers) != expected_states(case["ids"])
    if "error" in loop or len(loop["captured"]) != expected_states(case["ids"]):
        assert rejected, f"SGLang {release} gives the draft {loop.get('captured', loop.get('error'))}; ours: {ours}"
        return
    assert "hidden_states + residual" in loop["records"]  # the input of layer b, i.e. our layer b - 1
    assert list(ours.layers) == [b - 1 for b in loop["captured"]], f"SGLang {release} captures inputs {loop['captured']}"
    assert not rejected or -1 in ours.layers  # the embeddings are a capture, but never one we accept


def test_two_batch_overlap_loses_the_capture_exactly_where_the_launcher_refuses_it(probed):
    release, answers, _ = probed
    losing = set()
    for family in FAMILIES:
        tbo = answers[(family, 61, repr([1, 29, 57]))].get("capture_loop_tbo")
        if tbo is not None and ("error" in tbo or len(tbo["captured"]) < 3):
            losing.add(family)
    assert losing == set(engines.TWO_BATCH_OVERLAP_LOSES_CAPTURE), f"SGLang {release}: overlap loses the capture of {losing}"
