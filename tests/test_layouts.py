"""The layout adapters (eagle3/formats/layouts): each reads back what it writes, names and config; the release an
export records decides how its ids are read; the speculators layout records the serving shape's num_steps."""

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import write_data_manifest
from drafts import tiny_draft, write_draft
from eagle3.config import load_config
from eagle3.data.capture import dataset_dir
from eagle3.errors import ConversionError
from eagle3.export import export_draft
from eagle3.formats.checkpoint import RawCheckpoint, convert, detect_layout, draft_config, load_native, read_checkpoint
from eagle3.formats.layouts import LAYOUTS
from eagle3.formats.manifest import MANIFEST_FILE
from eagle3.stages import stage_key

TINY = Path(__file__).parents[1] / "configs" / "tiny-cpu.yaml"
KIMI = dict(target_family="kimi_k25", aux_layers=[2, 3, 5], target_num_hidden_layers=8)
SWITCHES = dict(fc_norm=True, norm_before_fc=True, norm_output=True)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_each_adapter_reads_back_the_names_it_writes(layout):
    adapter = LAYOUTS[layout]
    draft = tiny_draft(**SWITCHES)
    config = adapter.encode_config(draft.config, "0.5.17", 3)
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
    config = LAYOUTS[layout].encode_config(draft.config, "0.5.17", 3)
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
    native = write_draft(tmp_path / "native")
    assert speculative_tokens(convert(native, tmp_path / "default", to="speculators")) == 3
    assert speculative_tokens(convert(native, tmp_path / "five", to="speculators", num_steps=5)) == 5
    with pytest.raises(ConversionError, match="num_steps is 0: speculators' speculative_tokens must be at least 1"):
        convert(native, tmp_path / "zero", to="speculators", num_steps=0)
    assert not (tmp_path / "zero").exists()


def test_the_export_stage_writes_serving_num_steps_into_the_speculators_layout(tmp_path):
    overrides = [f"run.dir={tmp_path / 'run'}", f"target.path={tmp_path / 'no-target'}", "serving.num_steps=5",
                 "serving.context_length=512", "export.layouts=[sglang, speculators]"]
    config = load_config(TINY, overrides)
    write_draft(config.stage_dir("train") / "best")
    dataset_dir(config).mkdir(parents=True)
    write_data_manifest(dataset_dir(config) / MANIFEST_FILE, aux_layers=[0, 1, 2])
    dirs = export_draft(config, log=lambda line: None)["dirs"]
    assert speculative_tokens(Path(dirs["speculators"])) == 5
    assert load_file(Path(dirs["speculators"]) / "model.safetensors").keys() >= {"layers.0.mlp.up_proj.weight"}
    # another num_steps is another export
    three_steps = load_config(TINY, [o for o in overrides if not o.startswith("serving.num_steps=")])
    assert stage_key("export", config, ["train"]) != stage_key("export", three_steps, ["train"])
