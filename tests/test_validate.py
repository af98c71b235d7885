"""One test per validation problem: inject exactly that fault into a good checkpoint, expect its code."""

import json

import pytest
import torch

from conftest import write_data_manifest, write_target
from drafts import MLA, write_draft
from eagle3.resolve import load_config
from eagle3.errors import ConfigError
from eagle3.contract.problems import ProblemCode
from eagle3.algorithms.eagle3.validate import validate
from helpers import TINY, codes, edit_tensors

GOOD_DATA_LAYERS = [0, 1, 2]


@pytest.fixture
def good(tmp_path, sglang_draft, target_dir):
    manifest = write_data_manifest(tmp_path / "data-manifest.json", GOOD_DATA_LAYERS)
    return dict(path=sglang_draft, release="0.5.13", target=target_dir, data_manifest=manifest, context_length=512)


def run(good, **changes):
    report = validate(**{**good, **changes})
    free = [p.code for p in report.problems if not isinstance(p.code, ProblemCode)]
    assert not free, f"codes outside ProblemCode: {free}"
    return report


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def test_good_checkpoint_is_clean(good):
    report = run(good)
    assert report.problems == [] and report.ok


def test_missing_inputs_are_unknown_never_passed(sglang_draft):
    report = validate(sglang_draft)  # no release, target, manifest or context
    assert report.ok
    assert codes(report, "unknown") == {"hidden-size", "context-length"}
    edit_config(sglang_draft, eagle3=None)  # without our own record nothing is known about the target
    report = validate(sglang_draft, release="0.5.13")
    assert "captured-layers" in codes(report, "unknown")


def test_layers_0_names_are_skipped_up_to_0_5_11(good):
    def rename(tensors):
        for name in [n for n in tensors if n.startswith("midlayer.")]:
            tensors[name.replace("midlayer.", "layers.0.")] = tensors.pop(name)

    edit_tensors(good["path"], rename)
    for release in ("0.5.11", None):
        report = run(good, release=release)
        assert {"skipped-tensor", "missing-tensor"} <= codes(report)
        skipped = next(p for p in report.problems if p.code == "skipped-tensor")
        assert "layers.0" in skipped.message and "midlayer" in skipped.fix
    report = run(good, release="0.5.12", data_manifest=None)
    assert "skipped-tensor" not in codes(report) and "missing-tensor" not in codes(report)


def test_a_head_named_model_lm_head_is_dropped_by_every_release(good):
    edit_tensors(good["path"], lambda t: t.update({"model.lm_head.weight": t.pop("lm_head.weight")}))
    for release in ("0.5.11", "0.5.13", "0.5.23"):
        report = run(good, release=release)
        skipped = next(p for p in report.problems if p.code == "skipped-tensor")
        assert "model.lm_head.weight" in skipped.message and "rename model.lm_head.weight to lm_head.weight" in skipped.fix
        assert "lm_head.weight" in next(p for p in report.problems if p.code == "missing-tensor").message


@pytest.mark.parametrize(("top", "nested", "field"), [
    ({}, {"fc_norm": True}, "eagle_config.fc_norm"),
    ({}, {"use_aux_norm": True}, "eagle_config.use_aux_norm"),
    ({}, {"norm_output": True}, "eagle_config.norm_output"),
    ({"norm_before_fc": True}, {"norm_before_fc": False}, "eagle_config.norm_before_fc"),
])
def test_switches_where_sglang_does_not_read_them_are_refused(good, top, nested, field):
    config = json.loads((good["path"] / "config.json").read_text())
    config.update(top)
    config["eagle_config"].update(nested)
    (good["path"] / "config.json").write_text(json.dumps(config))
    report = run(good, release="0.5.23")
    (problem,) = [p for p in report.problems if p.code == "flag-misplaced"]
    assert problem.message.startswith(field) and "top level" in problem.fix


def test_sglangs_mla_draft_is_checked_as_its_loader_reads_it(tmp_path):
    path = write_draft(tmp_path / "mla", layout="sglang", release="0.5.23", fc_norm=True, norm_output=True, **MLA)
    assert validate(path, release="0.5.23").ok
    assert "config-architecture" in codes(validate(path, release="0.5.11"))  # not in that release
    assert "unsupported-flag" in codes(validate(path, release="0.5.12"))  # fc_norm, norm_output from 0.5.13
    edit_tensors(path, lambda t: t.update(d2t=t["d2t"] + torch.arange(t["d2t"].numel())))
    assert "d2t-absolute" in codes(validate(path, release="0.5.23"))  # the vocab map is checked
    pair = write_draft(tmp_path / "pair", layout="sglang", release="0.5.23", **MLA)
    edit_tensors(pair, lambda t: t.pop("midlayer.self_attn.kv_a_proj_with_mqa.weight"))
    (problem,) = [p for p in validate(pair, release="0.5.23").of("error") if "fused_qkv_a_proj_with_mqa" in p.message]
    assert "q_a_proj" in problem.message and problem.code == "missing-tensor"
    unsized = write_draft(tmp_path / "unsized", layout="sglang", release="0.5.23", **MLA)
    edit_config(unsized, q_lora_rank=None)
    assert any("q_lora_rank" in p.message for p in validate(unsized, release="0.5.23").of("error"))


def test_missing_required_tensor(good):
    edit_tensors(good["path"], lambda t: t.pop("midlayer.hidden_norm.weight"))
    assert codes(run(good)) == {"missing-tensor"}


@pytest.mark.parametrize(
    "name, shape",
    [
        ("fc.weight", (32, 64)),  # 2 aux states' width where the config says 3
        ("midlayer.self_attn.q_proj.weight", (32, 32)),  # qkv must read 2 x hidden
        ("lm_head.weight", (63, 32)),
    ],
)
def test_shape_mismatch(good, name, shape):
    edit_tensors(good["path"], lambda t: t.update({name: torch.zeros(shape, dtype=torch.bfloat16)}))
    report = run(good)
    assert codes(report) == {"shape-mismatch"}
    assert name in report.of("error")[0].message


def test_hidden_size_differs_from_the_target(good, tmp_path):
    report = run(good, target=write_target(tmp_path / "wide", hidden=64))
    assert codes(report) == {"hidden-size"}


def test_d2t_absolute_ids(good):
    edit_tensors(good["path"], lambda t: t.update(d2t=t["d2t"] + torch.arange(64)))
    report = run(good)
    assert codes(report) == {"d2t-absolute"}
    assert "hot_token_id = d2t + arange" in report.of("error")[0].message
    waived = load_config(TINY, ["export.waive=[d2t-absolute]"]).export.waive
    assert waived == [ProblemCode.D2T_ABSOLUTE] and report.errors(waived) == []


def test_export_waive_accepts_the_validation_codes_only():
    allowed = r"'eagle-not-eagle3', 'config-architecture', .* or 'context-length'"
    with pytest.raises(ConfigError, match=rf"export\.waive\.0: Input should be {allowed} \(got 'd2t-absolut'\)"):
        load_config(TINY, ["export.waive=[d2t-absolut]"])


def test_d2t_out_of_range(good):
    def push(tensors):
        tensors["d2t"][-1] = 10_000

    edit_tensors(good["path"], push)
    assert codes(run(good)) == {"d2t-out-of-range"}


def test_d2t_disagrees_with_t2d(good):
    def shift(tensors):
        t2d = tensors["t2d"]
        first, free = torch.nonzero(t2d)[0], torch.nonzero(~t2d)[-1]
        t2d[first], t2d[free] = False, True

    edit_tensors(good["path"], shift)
    assert codes(run(good)) == {"d2t-t2d-disagree"}


def test_unsorted_but_consistent_d2t_is_a_warning(good):
    def unsort(tensors):
        ids = tensors["d2t"] + torch.arange(64)
        ids[[0, 1]] = ids[[1, 0]]
        tensors["d2t"] = ids - torch.arange(64)
        tensors["lm_head.weight"] = tensors["lm_head.weight"][[1, 0] + list(range(2, 64))]

    edit_tensors(good["path"], unsort)
    report = run(good)
    assert report.ok and codes(report, "warning") == {"d2t-unsorted"}


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: t.update(d2t=t["d2t"].to(torch.int32)),
        lambda t: t.update(t2d=t["t2d"].to(torch.uint8)),
        lambda t: t.update({"norm.weight": torch.ones(32, dtype=torch.int64)}),
    ],
)
def test_wrong_dtypes(good, mutate):
    edit_tensors(good["path"], mutate)
    assert "dtype" in codes(run(good))


def test_weights_not_in_the_declared_dtype_is_a_warning(good):
    edit_tensors(good["path"], lambda t: t.update({"norm.weight": t["norm.weight"].float()}))
    report = run(good)
    assert report.ok and codes(report, "warning") == {"dtype"}


def test_draft_vocab_size_disagrees_or_is_missing(good):
    edit_config(good["path"], draft_vocab_size=100)
    assert {"draft-vocab-size", "shape-mismatch"} == codes(run(good))


def test_a_missing_or_null_draft_vocab_size_says_what_sglang_does(good):
    """Read from SGLang's loader (tests/conformance/test_loader.py runs it): a missing key fails at
    construction, null with a draft-vocabulary head fails the loader's assertion."""
    edit_config(good["path"], draft_vocab_size=None)  # removes the key
    (error,) = [p for p in run(good).of("error") if p.code == "draft-vocab-size"]
    assert "AttributeError" in error.message and error.fix == 'set "draft_vocab_size": 64'
    config = json.loads((good["path"] / "config.json").read_text())
    (good["path"] / "config.json").write_text(json.dumps({**config, "draft_vocab_size": None}))
    (error,) = [p for p in run(good).of("error") if p.code == "draft-vocab-size"]
    assert "fails an assertion on this 64-row head" in error.message


@pytest.mark.parametrize(
    ("change", "code", "severity"),
    [
        ({"model_type": None}, "config-model-type", "error"),
        ({"model_type": "llama_eagle"}, "config-model-type", "error"),
        ({"tie_word_embeddings": True}, "config-tie-embeddings", "error"),
        ({"torch_dtype": None}, "config-torch-dtype", "warning"),
        ({"architectures": ["Eagle3Speculator"]}, "config-architecture", "error"),
    ],
)
def test_config_fields_sglang_needs(good, change, code, severity):
    edit_config(good["path"], **change)
    assert code in codes(run(good), severity)


def test_aux_ids_only_at_the_top_level(good):
    edit_config(good["path"], eagle_config=None, eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    report = run(good)
    assert "aux-ids-top-level" in codes(report)
    # ... and SGLang's default (outputs [0, 1] on 4 layers) is not what the data were captured at
    assert "aux-ids-missing" in codes(report)


def test_captured_layers_differ_from_the_data(good, tmp_path):
    manifest = write_data_manifest(tmp_path / "other.json", [0, 1, 2])
    edit_config(good["path"], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 0]})  # order is irrelevant
    assert run(good, data_manifest=manifest).ok
    edit_config(good["path"], eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]})
    report = run(good, data_manifest=manifest)
    assert {"captured-layers-mismatch", "aux-ids-invalid", "aux-count"} <= codes(report)
    edit_config(good["path"], eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 2]})
    assert {"aux-ids-invalid", "captured-layers-mismatch"} <= codes(run(good, data_manifest=manifest))


def test_kimi_ids_copied_from_speculators_mismatch_on_0_5_12_only(tmp_path):
    target = write_target(tmp_path / "kimi", layers=61, hidden=32, architecture="KimiK25ForConditionalGeneration")
    manifest = write_data_manifest(tmp_path / "data.json", [1, 29, 57], layers=61, family="kimi_k25")
    draft = write_draft(tmp_path / "draft", layout="sglang", release="0.5.13", target_family="kimi_k25",
                        aux_layers=[1, 29, 57], target_num_hidden_layers=61)
    edit_config(draft, eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 30, 58]}, eagle3=None)
    common = dict(target=target, data_manifest=manifest, context_length=512)
    assert validate(draft, release="0.5.13", **common).ok
    late = validate(draft, release="0.5.12", **common)
    assert codes(late) == {"captured-layers-mismatch"}
    assert "[2, 30, 58]" in late.of("error")[0].message and "[1, 29, 57]" in late.of("error")[0].message
    assert codes(validate(draft, **common)) == {"aux-ids-ambiguous"}


def test_gemma3_served_where_its_capture_is_the_feed_forward_branch_differs_from_the_data(tmp_path):
    """Gemma 3 from 0.5.17 records the branch alone (docs/contracts.md): transformers features differ from what it
    serves; features SGLang computed on the served release are what it serves."""
    target = write_target(tmp_path / "gemma", architecture="Gemma3ForCausalLM")
    draft = write_draft(tmp_path / "draft", layout="sglang", release="0.5.16", target_family="gemma3",
                        aux_layers=GOOD_DATA_LAYERS)
    transformers_data = write_data_manifest(tmp_path / "local.json", GOOD_DATA_LAYERS, family="gemma3")
    common = dict(target=target, context_length=512)
    assert validate(draft, release="0.5.16", data_manifest=transformers_data, **common).ok
    branch = validate(draft, release="0.5.23", data_manifest=transformers_data, **common)
    assert codes(branch) == {"aux-states-differ"}
    assert "feed-forward branch" in branch.of("error")[0].message and "transformers" in branch.of("error")[0].message
    on_0_5_23 = write_data_manifest(tmp_path / "sglang.json", GOOD_DATA_LAYERS, family="gemma3", engine="sglang",
                                    engine_release="0.5.23")
    assert validate(draft, release="0.5.23", data_manifest=on_0_5_23, **common).ok
    assert codes(validate(draft, release="0.5.21", data_manifest=on_0_5_23, **common)) == {"aux-states-differ"}


def test_aux_ids_repeated_or_out_of_range(good):
    edit_config(good["path"], eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 0, 1]})
    assert "aux-ids-invalid" in codes(run(good))
    edit_config(good["path"], eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]})  # input of 4 never reached
    report = run(good)
    assert "aux-ids-invalid" in codes(report) and "never reached" in report.of("error")[0].message


def test_no_nested_ids_with_data_at_non_default_layers(good):
    edit_config(good["path"], eagle_config=None, eagle3=None)
    assert "aux-ids-missing" in codes(run(good))


def test_no_nested_ids_matching_the_default_is_a_warning(tmp_path):
    target = write_target(tmp_path / "t8", layers=8)
    manifest = write_data_manifest(tmp_path / "d.json", [1, 3, 4], layers=8)
    draft = write_draft(tmp_path / "draft", layout="sglang", release="0.5.13", aux_layers=[1, 3, 4], target_num_hidden_layers=8)
    edit_config(draft, eagle_config=None)
    report = validate(draft, release="0.5.13", target=target, data_manifest=manifest, context_length=512)
    assert report.ok and codes(report, "warning") == {"aux-ids-missing"}


def test_context_longer_than_max_position_embeddings(good):
    report = run(good, context_length=4096)
    assert codes(report) == {"context-length"}


def test_eagle_shaped_checkpoint(good):
    edit_tensors(good["path"], lambda t: t.update({"fc.weight": torch.zeros(32, 64, dtype=torch.bfloat16)}) or t.pop("midlayer.hidden_norm.weight"))
    assert codes(run(good)) == {"eagle-not-eagle3"}
    edit_config(good["path"], architectures=["LlamaForCausalLMEagle"])
    assert codes(run(good)) == {"eagle-not-eagle3"}


def test_switches_the_release_does_not_implement(good):
    edit_config(good["path"], norm_output=True)
    assert "unsupported-flag" in codes(run(good, release="0.5.11"))
    assert "unsupported-flag" not in codes(run(good, release="0.5.12"))
    edit_config(good["path"], norm_output=None, norm_before_residual=True)
    report = run(good, release="0.5.23")
    assert "unsupported-flag" in codes(report) and "no SGLang release" in report.of("error")[0].message


def test_two_aux_states_on_0_5_11(tmp_path, target_dir):
    draft = write_draft(tmp_path / "draft", layout="sglang", release="0.5.12", aux_layers=[0, 2])
    report = validate(draft, release="0.5.11", target=target_dir, context_length=512)
    assert "aux-count" in codes(report)
    assert validate(draft, release="0.5.12", target=target_dir, context_length=512).ok


def test_specforge_checkpoint_validates_clean(tmp_path):
    """SpecForge writes the sglang layout with no eagle_config, no embed_tokens and no target_hidden_size."""
    target = write_target(tmp_path / "t8", layers=8)
    draft = write_draft(tmp_path / "draft", layout="sglang", release="0.5.13", aux_layers=[1, 3, 4], target_num_hidden_layers=8)
    edit_config(draft, eagle_config=None, target_hidden_size=None, eagle3=None, head_dim=None)
    (draft / "manifest.json").unlink()
    report = validate(draft, release="0.5.13", target=target, context_length=512)
    assert report.ok and not report.of("warning")
    assert codes(report, "unknown") == {"captured-layers"}  # which layers the data used is not on record


def test_default_ids_collapse_on_a_four_layer_target(tmp_path, target_dir):
    draft = write_draft(tmp_path / "draft", layout="sglang", release="0.5.13")
    edit_config(draft, eagle_config=None, eagle3=None)
    report = validate(draft, release="0.5.13", target=target_dir, context_length=512)
    assert codes(report) == {"aux-count"}  # SGLang captures 2 distinct layers, fc expects 3
