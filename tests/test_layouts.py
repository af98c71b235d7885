"""The layout adapters (eagle3/algorithms/eagle3/layouts): each reads back what it writes, names and config; the release an
export records decides how its ids are read; the speculators layout records the serving shape's num_steps, names
the target as its verifier and ships the target's embedding (speculators' own loader runs on it in
tests/conformance/test_speculators.py)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_data_manifest
from drafts import tiny_draft, tiny_verifier, write_draft, write_tiny_target
from eagle3.cli import main
from eagle3.resolve import load_config
from eagle3.data.capture import dataset_dir
from eagle3.errors import ConversionError, UnreadableInput
from eagle3.export import export_draft
from eagle3.algorithms.eagle3.checkpoint import RawCheckpoint, convert, detect_layout, draft_config, load_native, read_checkpoint
from eagle3.algorithms.eagle3.layouts import LAYOUTS
from eagle3.algorithms.eagle3.layouts.speculators import ARCHITECTURE
from eagle3.contract.releases import SPECULATORS_RELEASE
from eagle3.records.manifest import MANIFEST_FILE
from eagle3.model.weights import target_verifier
from eagle3.stages.keys import stage_key

TINY = Path(__file__).parents[1] / "configs" / "tiny-cpu.yaml"
KIMI = dict(target_family="kimi_k25", aux_layers=[2, 3, 5], target_num_hidden_layers=8)
SWITCHES = dict(fc_norm=True, norm_before_fc=True, norm_output=True)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_adapter_reads_back_the_names_it_writes(layout):
    adapter = LAYOUTS[layout]
    draft = tiny_draft(**SWITCHES)
    config = adapter.encode_config(draft.config, "0.5.17", 3, tiny_verifier())
    names = adapter.tensor_names(list(draft.tensors))
    assert names.keys() == draft.tensors.keys() and len(set(names.values())) == len(names)
    assert {adapter.canonical_name(name, config) for name in names.values()} == set(draft.tensors)
    assert adapter.canonical_name("layers.1.mlp.up_proj.weight", config) is None  # a second layer has no place


def test_the_decoder_layer_name_belongs_to_its_layout():
    midlayer, layers_0 = "midlayer.mlp.up_proj.weight", "layers.0.mlp.up_proj.weight"
    assert LAYOUTS["native"].canonical_name(layers_0, {}) is None
    assert LAYOUTS["speculators"].canonical_name(midlayer, {}) is None
    assert LAYOUTS["speculators"].canonical_name(layers_0, {}) == midlayer
    # sglang is read as the newest loader reads it: both spellings load as the one layer
    assert LAYOUTS["sglang"].canonical_name(layers_0, {}) == LAYOUTS["sglang"].canonical_name(midlayer, {}) == midlayer


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_layout_detects_its_config_and_decodes_it_to_the_same_draft(tmp_path, layout):
    draft = tiny_draft(**KIMI, **SWITCHES)
    config = LAYOUTS[layout].encode_config(draft.config, "0.5.17", 3, tiny_verifier())
    assert detect_layout(config, tmp_path) == layout
    raw = RawCheckpoint(tmp_path, layout, config, draft.tensors)
    assert draft_config(raw) == draft.config  # exports record the target: the caller need not know it


def sglang_export_for_0_5_13(tmp_path: Path) -> Path:
    native = write_draft(tmp_path / "native", **KIMI)
    exported = convert(native, tmp_path / "sglang", to="sglang", release="0.5.13")
    ids = json.loads((exported / "config.json").read_text())["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert ids == [3, 4, 6]  # inputs of 3, 4, 6 on 0.5.13; on 0.5.12 they would mean the outputs of 3, 4, 6
    return exported


def test_the_recorded_release_decides_how_ids_are_read_and_another_given_one_is_logged(tmp_path):
    exported = sglang_export_for_0_5_13(tmp_path)
    lines = []
    back = convert(exported, tmp_path / "back", to="native", release="0.5.12", log=lines.append)
    assert load_native(back).config.aux_layers == [2, 3, 5]
    assert len(lines) == 1 and str(exported) in lines[0]
    assert "encoded for SGLang 0.5.13 (recorded in config.json 'eagle3'), not for 0.5.12" in lines[0]
    convert(exported, tmp_path / "same", to="native", release="0.5.13", log=lines.append)
    convert(exported, tmp_path / "none", to="native", log=lines.append)
    assert len(lines) == 1  # nothing to say when the caller agrees or gives none


def test_without_our_record_the_given_release_decides(tmp_path):
    raw = read_checkpoint(sglang_export_for_0_5_13(tmp_path))
    raw.config.pop("eagle3")  # as another exporter writes it
    kimi = dict(target_family="kimi_k25", target_num_layers=8)
    assert draft_config(raw, release="0.5.13", **kimi).aux_layers == [2, 3, 5]
    assert draft_config(raw, release="0.5.12", **kimi).aux_layers == [3, 4, 6]
    with pytest.raises(ConversionError, match="ambiguous across releases"):
        draft_config(raw, **kimi)


def speculative_tokens(directory: Path) -> int:
    config = json.loads((directory / "config.json").read_text())
    [method] = config["speculators_config"]["proposal_methods"]
    return method["speculative_tokens"]


def test_speculative_tokens_are_the_num_steps_given(tmp_path):
    native, verifier = write_draft(tmp_path / "native"), tiny_verifier()
    assert speculative_tokens(convert(native, tmp_path / "default", to="speculators", verifier=verifier)) == 3
    assert speculative_tokens(convert(native, tmp_path / "five", to="speculators", num_steps=5, verifier=verifier)) == 5
    with pytest.raises(ConversionError, match="num_steps is 0: speculators' speculative_tokens must be at least 1"):
        convert(native, tmp_path / "zero", to="speculators", num_steps=0, verifier=verifier)
    assert not (tmp_path / "zero").exists()


def test_the_speculators_layout_names_its_verifier_and_ships_the_targets_embedding(tmp_path):
    target = write_tiny_target(tmp_path / "target", prefix="language_model.")
    verifier = target_verifier(target, "language_model.")
    exported = convert(write_draft(tmp_path / "native"), tmp_path / "spec", to="speculators", verifier=verifier)
    config = json.loads((exported / "config.json").read_text())
    assert config["architectures"] == [ARCHITECTURE] == ["Eagle3DraftModel"]
    assert config["speculators_version"] == SPECULATORS_RELEASE == "0.9.0"
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(target.resolve()),
                                                        "architectures": ["LlamaForCausalLM"]}
    embed = load_file(exported / "model.safetensors")["embed_tokens.weight"]
    target_embed = load_file(target / "model.safetensors")["language_model.model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16 and torch.equal(embed, target_embed)
    assert load_native(exported).tensors.keys() == tiny_draft().tensors.keys()  # read back without it


def test_a_speculators_export_needs_its_target(tmp_path, capsys):
    native = write_draft(tmp_path / "native")
    needs_target = r"names its verifier .* pass the target \(`eagle3 convert ... --target DIR`\)"
    with pytest.raises(ConversionError, match=needs_target):
        convert(native, tmp_path / "spec", to="speculators")
    other_size = r"the target's embedding \(other\) is \[256, 48\], the draft needs \[256, 32\]"
    with pytest.raises(ConversionError, match=other_size):
        convert(native, tmp_path / "spec", to="speculators", verifier=tiny_verifier(hidden=48, name="other"))
    assert not (tmp_path / "spec").exists()
    assert main(["convert", str(native), str(tmp_path / "spec"), "--to", "speculators"]) == 1
    assert "pass the target (`eagle3 convert ... --target DIR`)" in capsys.readouterr().err
    target = write_tiny_target(tmp_path / "target")
    assert main(["convert", str(native), str(tmp_path / "spec"), "--to", "speculators", "--target", str(target),
                 "--num-steps", "4"]) == 0
    assert speculative_tokens(tmp_path / "spec") == 4
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(target.resolve())


def test_a_speculators_export_can_name_its_verifier_as_published(tmp_path, capsys):
    """A hub id instead of this machine's path, for an export loaded elsewhere; the embedding still comes from
    --target, and validate here leaves the verifier it cannot reach offline unchecked, not failed."""
    native, target = write_draft(tmp_path / "native"), write_tiny_target(tmp_path / "target")
    spec = tmp_path / "spec"
    assert main(["convert", str(native), str(spec), "--to", "speculators", "--target", str(target),
                 "--verifier", "example-org/tiny-target"]) == 0
    config = json.loads((spec / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {"name_or_path": "example-org/tiny-target",
                                                        "architectures": ["LlamaForCausalLM"]}
    capsys.readouterr()
    assert main(["validate", str(spec), "--loader", "speculators", "--target", str(target), "--json"]) == 0
    verifier = [p for p in json.loads(capsys.readouterr().out)["problems"] if p["code"] == "verifier"]
    assert [p["severity"] for p in verifier] == ["unknown"]
    assert main(["convert", str(native), str(tmp_path / "sglang"), "--to", "sglang", "--target", str(target),
                 "--verifier", "example-org/tiny-target"]) == 1
    assert "--verifier names the verifier of a speculators export" in capsys.readouterr().err
    assert not (tmp_path / "sglang").exists()


def test_the_export_stage_writes_serving_num_steps_and_the_target_into_the_speculators_layout(tmp_path):
    target = write_tiny_target(tmp_path / "target")
    overrides = [f"run.dir={tmp_path / 'run'}", f"target.path={target}", "serving.num_steps=5",
                 "serving.context_length=512", "export.layouts=[sglang, speculators]"]
    config = load_config(TINY, overrides)
    write_draft(config.stage_dir("train") / "best")
    dataset_dir(config.run, config.training).mkdir(parents=True)
    write_data_manifest(dataset_dir(config.run, config.training) / MANIFEST_FILE, aux_layers=[0, 1, 2])
    result = export_draft(config.run, config.draft, config.target, config.training, config.export, config.serving,
                          log=lambda line: None)
    spec = Path(result["dirs"]["speculators"])
    assert speculative_tokens(spec) == 5
    assert load_file(spec / "model.safetensors").keys() >= {"layers.0.mlp.up_proj.weight", "embed_tokens.weight"}
    assert result["validation"]["speculators"]["ok"] and result["validation"]["speculators"]["engine"] == "speculators"
    # another num_steps, or another target path, is another export
    named = load_config(TINY, [*overrides, "export.verifier=example-org/tiny-target"])
    assert stage_key("export", named, {"trained": "train"}) != stage_key("export", config, {"trained": "train"})
    spec = Path(export_draft(named.run, named.draft, named.target, named.training, named.export, named.serving,
                             log=lambda line: None)["dirs"]["speculators"])
    recorded = json.loads((spec / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"]
    assert recorded == "example-org/tiny-target"
    for field in ("serving.num_steps=", "target.path="):
        other = load_config(TINY, [o for o in overrides if not o.startswith(field)])
        assert stage_key("export", config, {"trained": "train"}) != stage_key("export", other, {"trained": "train"})


def test_the_export_stage_refuses_a_speculators_layout_without_the_targets_weights(tmp_path):
    overrides = [f"run.dir={tmp_path / 'run'}", f"target.path={tmp_path / 'no-target'}",
                 "serving.context_length=512", "export.layouts=[sglang, speculators]"]
    config = load_config(TINY, overrides)
    write_draft(config.stage_dir("train") / "best")
    with pytest.raises(UnreadableInput, match="no-target: no target model directory here; the speculators layout "
                                              "ships the target's embedding"):
        export_draft(config.run, config.draft, config.target, config.training, config.export, config.serving,
                     log=lambda line: None)
