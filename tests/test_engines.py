import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eagle3.contract import engines
import eagle3.algorithms.eagle3.contract as loader
from eagle3.contract.releases import parse_release
from eagle3.contract.engines import sglang_capture, sglang_ids_for_layers
from eagle3.algorithms.eagle3.contract import loaded_name, loader_rule

KIMI_LAYERS = 61


class TestKimiWorkedExample:
    """docs/contracts.md: speculators ids [2, 30, 58] (= our [1, 29, 57]) copied unchanged into eagle_config."""

    def test_release_0_5_12_captures_one_layer_late(self):
        capture = sglang_capture([2, 30, 58], "kimi_k25", "0.5.12", KIMI_LAYERS)
        assert capture.status == "known"
        assert engines.captured_inputs([2, 30, 58], engines.aux_id_rule("kimi_k25", (0, 5, 12)), KIMI_LAYERS) == [3, 31, 59]
        assert list(capture.layers) == [2, 30, 58]  # outputs of 2, 30, 58: one later than the data's [1, 29, 57]

    def test_release_0_5_13_captures_the_trained_layers(self):
        capture = sglang_capture([2, 30, 58], "deepseek_v2", "0.5.13", KIMI_LAYERS)
        assert list(capture.layers) == [1, 29, 57]

    def test_no_release_is_ambiguous(self):
        capture = sglang_capture([2, 30, 58], "deepseek_v2", None, KIMI_LAYERS)
        assert capture.status == "ambiguous" and "pass the release" in capture.explanation

    def test_ids_starting_with_one_mean_the_same_on_every_release(self):
        capture = sglang_capture([1, 29, 57], "deepseek_v2", None, KIMI_LAYERS)
        assert capture.status == "known" and list(capture.layers) == [1, 29, 57]
        assert sglang_ids_for_layers([1, 29, 57], "deepseek_v2", None, KIMI_LAYERS) == [1, 29, 57]

    def test_speculators_numbering_is_ours_plus_one(self):
        assert engines.vllm_ids([1, 29, 57]) == [2, 30, 58]
        assert engines.layers_from_vllm_ids([2, 30, 58]) == [1, 29, 57]


def test_default_ids_capture_inputs_2_n_half_n_minus_3():
    capture = sglang_capture(None, "llama", "0.5.20", KIMI_LAYERS)
    assert list(capture.layers) == [1, 29, 57]
    # On a 4-layer target the default collapses to two distinct layers.
    assert list(sglang_capture(None, "llama", "0.5.13", 4).layers) == [0, 1]


def test_llama_adds_one_on_every_release():
    for release in ("0.5.10", "0.5.12", "0.5.13", "0.5.23"):
        assert list(sglang_capture([0, 1, 2], "llama", release, 4).layers) == [0, 1, 2]


def test_deepseek_first_id_zero_captures_the_embeddings_from_0_5_13():
    capture = sglang_capture([0, 1, 2], "deepseek_v2", "0.5.13", 8)
    assert list(capture.layers) == [-1, 0, 1]


def test_layers_starting_at_zero_cannot_be_expressed_for_deepseek_0_5_13():
    with pytest.raises(ValueError, match="no ascending aux ids make deepseek_v2 on SGLang 0.5.13 capture layers"):
        sglang_ids_for_layers([0, 1, 2], "deepseek_v2", "0.5.13", 8)


def test_gpt_oss_keeps_ids_when_the_last_is_n_from_0_5_17():
    capture = sglang_capture([2, 4, 8], "gpt_oss", "0.5.17", 8)
    assert list(capture.layers) == [1, 3, 7]  # id n = the last layer's output
    capture = sglang_capture([2, 4, 8], "gpt_oss", "0.5.16", 8)
    assert list(capture.layers) == [2, 4] and capture.lost_ids == (9,)


def test_ids_beyond_the_loop_are_lost():
    capture = sglang_capture([1, 2, 3], "llama", "0.5.13", 4)
    assert list(capture.layers) == [1, 2] and capture.lost_ids == (4,)


def test_unknown_pairs_are_reported_never_assumed():
    assert sglang_capture([1, 2], "qwen3_5", "0.5.13", 8).status == "unknown"
    assert sglang_capture([1, 2], "llama", "0.5.9", 8).status == "unknown"
    assert sglang_capture([1, 2], "llama", "0.6.0", 8).status == "unknown"
    assert sglang_capture([1, 2], None, "0.5.13", 8).status == "unknown"


def test_post_releases_follow_their_release():
    assert parse_release("0.5.13.post1") == (0, 5, 13)
    assert list(sglang_capture([2, 30, 58], "deepseek_v2", "0.5.12.post1", KIMI_LAYERS).layers) == [2, 30, 58]
    with pytest.raises(ValueError, match="not an SGLang release"):
        parse_release("latest")


RELEASES = ["0.5.10", "0.5.11", "0.5.12", "0.5.13", "0.5.16", "0.5.17", "0.5.23", None]


@settings(max_examples=200, deadline=None)
@given(
    family=st.sampled_from(sorted(engines.KNOWN_FAMILIES)),
    release=st.sampled_from(RELEASES),
    num_layers=st.integers(4, 80),
    data=st.data(),
)
def test_ids_exist_exactly_where_the_rules_allow_them(family, release, num_layers, data):
    layers = sorted(data.draw(st.sets(st.integers(0, num_layers - 2), min_size=1, max_size=4)))
    if release is not None and engines.aux_id_rule(family, parse_release(release)) is None:
        with pytest.raises(ValueError, match=f"'{family}' on SGLang {release} is not in the aux-id table"):
            sglang_ids_for_layers(layers, family, release, num_layers)
        return
    if family not in ("deepseek_v2", "kimi_k25", "glm4_moe_lite"):
        expressible = True  # +1 always, or gpt_oss whose ids never reach n here
    elif release is None:
        expressible = layers[0] == 1  # the only ids meaning the same before and after 0.5.13
    elif parse_release(release) <= (0, 5, 12):
        expressible = True
    else:
        expressible = layers[0] >= 1  # a first id of 1 would trigger the +1, so layer 0 is out of reach
    if not expressible:
        with pytest.raises(ValueError, match="no ascending aux ids make"):
            sglang_ids_for_layers(layers, family, release, num_layers)
        return
    ids = sglang_ids_for_layers(layers, family, release, num_layers)
    assert ids in (layers, [k + 1 for k in layers])
    assert list(sglang_capture(ids, family, release, num_layers).layers) == layers


def test_literal_ids_for_known_cases():
    assert sglang_ids_for_layers([0, 1, 2], "llama", "0.5.11", 4) == [0, 1, 2]
    assert sglang_ids_for_layers([2, 3, 5], "deepseek_v2", "0.5.13", 8) == [3, 4, 6]  # vLLM numbering
    assert sglang_ids_for_layers([2, 3, 5], "deepseek_v2", "0.5.12", 8) == [2, 3, 5]
    assert sglang_ids_for_layers([1, 3, 5], "gpt_oss", "0.5.17", 8) == [1, 3, 5]


class TestLoaderNames:
    def test_layers_0_is_skipped_up_to_0_5_11_and_loaded_from_0_5_12(self):
        old, _ = loader_rule("0.5.11")
        new, _ = loader_rule("0.5.12")
        assert loaded_name("layers.0.self_attn.q_proj.weight", old, set()) is None
        assert loaded_name("layers.0.self_attn.q_proj.weight", new, set()) == "midlayer.self_attn.q_proj.weight"
        assert loaded_name("midlayer.self_attn.q_proj.weight", old, set()) == "midlayer.self_attn.q_proj.weight"
        assert loaded_name("model.fc.weight", old, set()) == "fc.weight"

    def test_no_release_or_an_unknown_one_means_the_strictest_rule(self):
        rule, note = loader_rule(None)
        assert rule is loader.STRICTEST_LOADER_RULE and "strictest" in note
        rule, note = loader_rule("0.7.0")
        assert rule is loader.STRICTEST_LOADER_RULE and "not in the table" in note
        assert loader_rule("0.5.13")[1] == ""

    def test_switch_tensors_load_only_where_implemented_and_enabled(self):
        rule_16, _ = loader_rule("0.5.16")
        rule_17, _ = loader_rule("0.5.17")
        assert loaded_name("input_norm.weight", rule_16, {"norm_before_fc"}) is None
        assert loaded_name("input_norm.weight", rule_17, {"norm_before_fc"}) == "input_norm.weight"
        assert loaded_name("input_norm.weight", rule_17, set()) is None
        assert loaded_name("fc_norm.0.weight", rule_16, {"fc_norm"}) == "fc_norm.0.weight"

    def test_enabled_flags_read_top_level_and_nested(self):
        assert loader.enabled_flags({"norm_output": True, "eagle_config": {"norm_before_fc": True}}) == {
            "norm_output",
            "norm_before_fc",
        }
        assert loader.enabled_flags({"use_aux_norm": True}) == {"fc_norm"}
