"""`eagle3 validate --loader speculators`: what speculators' loader needs, one fault per test, each injected into a
good export (speculators' own loader runs on the same faults in tests/conformance/test_speculators.py)."""

import json

import pytest
import torch

from conftest import write_data_manifest
from drafts import write_draft, write_tiny_target
from eagle3.cli import main
from eagle3.algorithms.eagle3.checkpoint import convert, load_native
from eagle3.contract.problems import ProblemCode as Code
from eagle3.algorithms.eagle3.validate import validate
from eagle3.model.weights import target_verifier
from helpers import codes, edit_tensors

DATA_LAYERS = [0, 1, 2]


@pytest.fixture
def good(tmp_path):
    target = write_tiny_target(tmp_path / "target")
    export = convert(write_draft(tmp_path / "native"), tmp_path / "spec", to="speculators",
                     verifier=target_verifier(target))
    manifest = write_data_manifest(tmp_path / "data-manifest.json", DATA_LAYERS)
    return dict(path=export, engine="speculators", target=target, data_manifest=manifest, context_length=512)


def edit_spec(path, change):
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


def test_our_export_is_clean(good):
    report = validate(**good)
    assert report.problems == [] and report.engine_release == "0.9.0"
    del good["target"]  # the verifier it names is a local directory: read for the target's facts
    assert validate(**good).problems == []


def verifier(name):
    return lambda c: c["speculators_config"]["verifier"].update(name_or_path=name)


def layer(**fields):
    return lambda c: c["transformer_layer_config"].update(fields)


@pytest.mark.parametrize(("change", "code", "severity", "phrase"), [
    (verifier(None), Code.VERIFIER, "error", "through AutoConfig from the name None"),
    (verifier("/nowhere/kimi"), Code.VERIFIER, "warning", "no directory on this machine"),
    (verifier("moonshotai/Kimi-K2.5"), Code.VERIFIER, "unknown", "a hub id?"),
    (lambda c: c.update(speculators_model_type="eagle"), Code.SPECULATORS_CONFIG, "error", "not 'eagle3'"),
    (lambda c: c.update(norm_before_fc=True, fc_norm=True), Code.SPECULATORS_CONFIG, "error", "both set"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].update(speculative_tokens=0), Code.SPECULATORS_CONFIG,
     "error", "speculative_tokens >= 1"),
    (lambda c: c["speculators_config"].update(default_proposal_method="tree"), Code.SPECULATORS_CONFIG, "error",
     "none of the proposal_methods"),
    (layer(model_type="mistral"), Code.SPECULATORS_CONFIG, "error", "for llama, qwen3 only"),
    (layer(num_hidden_layers=2), Code.CONFIG_NUM_LAYERS, "error", "leaves all but layers.0 uninitialised"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]), Code.AUX_IDS_INVALID, "error",
     "within [0, 4]"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[]), Code.AUX_IDS_INVALID, "error", "[] must be distinct"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]), Code.CAPTURED_LAYERS_MISMATCH, "error",
     "capture layers [-1, 0, 1], but the training data were captured at layers [0, 1, 2]"),
    (lambda c: c.pop("eagle_aux_hidden_state_layer_ids"), Code.AUX_IDS_MISSING, "error",
     "its default captures layers [1, 1, 0]"),
    (layer(max_position_embeddings=256), Code.CONTEXT_LENGTH, "error", "is 256 but the server's context is 512"),
])
def test_config_faults(good, change, code, severity, phrase):
    edit_spec(good["path"], change)
    found = [p for p in validate(**good).problems if p.code == code and p.severity == severity]
    assert found and phrase in found[0].message, validate(**good).problems


def test_a_verifier_of_another_hidden_size_is_refused(good, tmp_path):
    edit_spec(good["path"], verifier(str(write_tiny_target(tmp_path / "wide", hidden=64))))
    assert codes(validate(**good)) == {Code.VERIFIER}


def test_without_embed_tokens_the_loader_keeps_whatever_memory_it_got(good):
    edit_tensors(good["path"], lambda t: t.pop("embed_tokens.weight"))
    [problem] = validate(**good).of("error")
    assert problem.code == Code.MISSING_TENSOR and "copies the verifier's only into a NaN tensor" in problem.message


def test_sglang_names_in_a_speculators_config_are_dropped(good):
    edit_tensors(good["path"], lambda t: t.update({n.replace("layers.0.", "midlayer."): t.pop(n)
                                                    for n in [n for n in t if n.startswith("layers.0.")]}))
    skipped = [p for p in validate(**good).of("error") if p.code == Code.SKIPPED_TENSOR]
    assert skipped and skipped[0].fix == "rename midlayer.* to layers.0.*"
    assert Code.MISSING_TENSOR in codes(validate(**good))


def test_fc_is_sized_from_hidden_size_not_target_hidden_size(good):
    edit_spec(good["path"], lambda c: c.update(target_hidden_size=48))
    edit_tensors(good["path"], lambda t: t.update({"fc.weight": torch.zeros(32, 144, dtype=torch.bfloat16)}))
    [problem] = validate(**good).of("error")
    assert problem.code == Code.SHAPE_MISMATCH and "fc.weight [32, 144] (config implies [32, 96])" in problem.message


def test_an_export_of_the_old_layout_still_reads_and_validation_names_what_it_lacks(good, tmp_path):
    """What this project wrote before: no verifier, no embedding, the old class name and version."""
    edit_tensors(good["path"], lambda t: t.pop("embed_tokens.weight"))
    edit_spec(good["path"], lambda c: (c.update(architectures=["Eagle3Speculator"], speculators_version="0.1.0"),
                                       c["speculators_config"].update(verifier={"name_or_path": None,
                                                                                "architectures": []})))
    assert codes(validate(**good)) == {Code.VERIFIER, Code.MISSING_TENSOR}
    back = convert(good["path"], tmp_path / "back", to="native")
    assert load_native(back).config == load_native(tmp_path / "native").config


def test_the_command_line(good, capsys):
    args = ["validate", str(good["path"]), "--loader", "speculators", "--target", str(good["target"])]
    assert main(args) == 0 and "speculators 0.9.0" in capsys.readouterr().out
    edit_spec(good["path"], verifier(None))
    assert main(args + ["--json"]) == 1
    assert json.loads(capsys.readouterr().out)["problems"][0]["code"] == "verifier"
    assert main(args + ["--release", "0.8.0"]) == 2
    assert "only the loader of speculators 0.9.0 was read" in capsys.readouterr().err
