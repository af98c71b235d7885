import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafts import tiny_draft, tiny_verifier, write_draft
from eagle3.errors import ConversionError, UnreadableInput
from eagle3.algorithms.eagle3.checkpoint import convert, load_native, save_native_draft
from eagle3.algorithms.eagle3.contract import LAYER_TENSORS, loaded_name, loader_rule
from eagle3.algorithms.eagle3.layouts import LAYOUTS


def assert_same_draft(a, b):
    assert a.config == b.config
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert a.tensors[name].dtype == b.tensors[name].dtype
        assert torch.equal(a.tensors[name], b.tensors[name]), name  # bit-identical


@pytest.mark.parametrize(
    ("family", "release", "layers", "num_layers"),
    [
        ("llama", "0.5.11", [0, 1, 2], 4),
        ("llama", None, [0, 1, 2], 4),
        ("deepseek_v2", "0.5.12", [1, 3, 5], 8),
        ("deepseek_v2", "0.5.13", [2, 3, 5], 8),
        ("deepseek_v2", None, [1, 3, 5], 8),
    ],
)
def test_round_trips_are_lossless(tmp_path, family, release, layers, num_layers):
    overrides = dict(target_family=family, aux_layers=layers, target_num_hidden_layers=num_layers)
    native = write_draft(tmp_path / "native", **overrides)
    convert(native, tmp_path / "sglang", to="sglang", release=release)
    convert(tmp_path / "sglang", tmp_path / "spec", to="speculators", verifier=tiny_verifier())
    convert(tmp_path / "spec", tmp_path / "sglang2", to="sglang", release=release)
    convert(tmp_path / "sglang2", tmp_path / "back", to="native")
    original = load_native(native)
    assert_same_draft(original, load_native(tmp_path / "back"))
    assert load_file(tmp_path / "sglang" / "model.safetensors").keys() == load_file(tmp_path / "sglang2" / "model.safetensors").keys()


def test_sglang_export_has_every_field_sglang_needs(tmp_path):
    write_draft(tmp_path / "native")
    convert(tmp_path / "native", tmp_path / "sglang", to="sglang", release="0.5.13")
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is False
    assert config["num_hidden_layers"] == 1 and config["torch_dtype"] == "bfloat16"
    assert config["draft_vocab_size"] == 64 and config["vocab_size"] == 256
    assert config["hidden_size"] == config["target_hidden_size"] == 32
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    assert "eagle_aux_hidden_state_layer_ids" not in config  # SGLang reads only the nested ids
    names = load_file(tmp_path / "sglang" / "model.safetensors").keys()
    assert {f"midlayer.{t}" for t in LAYER_TENSORS} <= names and not any(n.startswith("layers.") for n in names)
    manifest = json.loads((tmp_path / "sglang" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "config.json"} and manifest["layout"] == "sglang"


def test_speculators_export_uses_layers_0_and_vllm_numbering(tmp_path):
    write_draft(tmp_path / "native")
    convert(tmp_path / "native", tmp_path / "spec", to="speculators", verifier=tiny_verifier())
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert config["speculators_model_type"] == "eagle3" and config["norm_before_residual"] is False
    assert config["transformer_layer_config"]["hidden_size"] == 32
    names = load_file(tmp_path / "spec" / "model.safetensors").keys()
    assert "layers.0.hidden_norm.weight" in names and not any(n.startswith("midlayer.") for n in names)


def _speculators_draft(tmp_path, **config_changes):
    write_draft(tmp_path / "native", target_family="deepseek_v2", aux_layers=[1, 3, 5], target_num_hidden_layers=8)
    convert(tmp_path / "native", tmp_path / "spec", to="speculators", verifier=tiny_verifier())
    path = tmp_path / "spec" / "config.json"
    config = json.loads(path.read_text())
    config.update(config_changes)
    config.pop("eagle3")  # as speculators itself writes it: no record of ours
    path.write_text(json.dumps(config))
    return tmp_path / "spec"


@pytest.mark.parametrize("release", ["0.5.11", "0.5.16", "0.5.23", None])
def test_norm_before_residual_is_refused_for_every_release(tmp_path, release):
    spec = _speculators_draft(tmp_path, norm_before_residual=True)
    with pytest.raises(ConversionError, match="norm_before_residual.*no SGLang release read implements it"):
        convert(spec, tmp_path / "out", to="sglang", release=release, target_num_layers=8, target_family="deepseek_v2")
    assert not (tmp_path / "out").exists()


def test_missing_norm_before_residual_means_true_as_vllm_reads_it(tmp_path):
    spec = _speculators_draft(tmp_path)
    config = json.loads((spec / "config.json").read_text())
    del config["norm_before_residual"]
    (spec / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="norm_before_residual"):
        convert(spec, tmp_path / "out", to="sglang", release="0.5.13", target_num_layers=8, target_family="deepseek_v2")


def test_norm_output_needs_0_5_12(tmp_path):
    spec = _speculators_draft(tmp_path, norm_output=True)
    kwargs = dict(to="sglang", target_num_layers=8, target_family="deepseek_v2")
    with pytest.raises(ConversionError, match=r"norm_output, which SGLang 0.5.11 does not implement"):
        convert(spec, tmp_path / "old", release="0.5.11", **kwargs)
    with pytest.raises(ConversionError, match=r"norm_output, which SGLang ≤ 0.5.11 \(the strictest"):
        convert(spec, tmp_path / "none", **kwargs)
    convert(spec, tmp_path / "new", release="0.5.12", **kwargs)
    assert json.loads((tmp_path / "new" / "config.json").read_text())["norm_output"] is True


def test_norm_before_fc_needs_0_5_17_and_keeps_its_tensor(tmp_path):
    draft = tiny_draft(norm_before_fc=True)
    save_native_draft(draft, tmp_path / "native", to="native")
    with pytest.raises(ConversionError, match="norm_before_fc, which SGLang 0.5.16 does not implement"):
        convert(tmp_path / "native", tmp_path / "old", to="sglang", release="0.5.16")
    convert(tmp_path / "native", tmp_path / "new", to="sglang", release="0.5.17")
    assert load_file(tmp_path / "new" / "model.safetensors")["input_norm.weight"].shape == (96,)
    convert(tmp_path / "new", tmp_path / "back", to="native")
    assert_same_draft(load_native(tmp_path / "native"), load_native(tmp_path / "back"))


def test_three_aux_states_are_required_up_to_0_5_11(tmp_path):
    write_draft(tmp_path / "native", aux_layers=[0, 2])
    with pytest.raises(ConversionError, match="exactly 3 aux states; the draft has 2"):
        convert(tmp_path / "native", tmp_path / "out", to="sglang", release="0.5.11")
    convert(tmp_path / "native", tmp_path / "out", to="sglang", release="0.5.12")


def test_ambiguous_ids_need_a_release(tmp_path):
    write_draft(tmp_path / "native", target_family="deepseek_v2", aux_layers=[2, 3, 5], target_num_hidden_layers=8)
    with pytest.raises(ConversionError, match="deepseek_v2 on SGLang \\(any release\\)"):
        convert(tmp_path / "native", tmp_path / "out", to="sglang")
    assert not (tmp_path / "out").exists()


def test_sglang_ids_that_disagree_with_the_recorded_layers_are_refused(tmp_path):
    write_draft(tmp_path / "native", target_family="deepseek_v2", aux_layers=[2, 3, 5], target_num_hidden_layers=8)
    convert(tmp_path / "native", tmp_path / "sglang", to="sglang", release="0.5.13")
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [3, 4, 6]  # inputs of 3, 4, 6 on 0.5.13
    config["eagle3"]["engine_release"] = "0.5.12"  # where they mean the outputs of 3, 4, 6
    (tmp_path / "sglang" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match=r"capture layers \[3, 4, 6\] but it was trained on layers \[2, 3, 5\]"):
        convert(tmp_path / "sglang", tmp_path / "out", to="native")


def _sglang_with(tmp_path, mutate):
    write_draft(tmp_path / "native")
    convert(tmp_path / "native", tmp_path / "sglang", to="sglang", release="0.5.13")
    path = tmp_path / "sglang" / "model.safetensors"
    tensors = load_file(path)
    mutate(tensors)
    save_file(tensors, path)
    return tmp_path / "sglang"


@pytest.mark.parametrize(
    ("mutate", "pattern"),
    [
        (lambda t: t.update(d2t=t["d2t"] + torch.arange(64)), "d2t is not offsets"),
        (lambda t: t.update({"layers.1.mlp.up_proj.weight": torch.zeros(2)}), "no place in the sglang layout"),
        (lambda t: t.pop("norm.weight"), r"missing tensors \['norm.weight'\]"),
        (lambda t: t.update({"fc.weight": torch.zeros(32, 64, dtype=torch.bfloat16)}), "fc.weight has shape"),
        (lambda t: t.update({"norm.weight": torch.ones(32, dtype=torch.int32)}), "norm.weight is torch.int32"),
    ],
)
def test_conversion_refuses_what_a_loader_would_skip_or_misread(tmp_path, mutate, pattern):
    src = _sglang_with(tmp_path, mutate)
    with pytest.raises(ConversionError, match=pattern):
        convert(src, tmp_path / "out", to="speculators", verifier=tiny_verifier())
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_sglang_layers_0_names_convert_to_the_layout_every_release_loads(tmp_path):
    """SGLang >= 0.5.12 loads layers.0.*, and validate prescribes this conversion for 0.5.11."""
    src = _sglang_with(tmp_path, lambda t: t.update(
        {n.replace("midlayer.", "layers.0."): t.pop(n) for n in [n for n in t if n.startswith("midlayer.")]}))
    convert(src, tmp_path / "out", to="sglang", release="0.5.11")
    written = load_file(tmp_path / "out" / "model.safetensors")
    original = load_file(tmp_path / "sglang" / "model.safetensors")
    assert not [n for n in written if n.startswith("layers.")]
    assert torch.equal(written["midlayer.self_attn.q_proj.weight"], original["layers.0.self_attn.q_proj.weight"])


def test_a_head_no_loader_reads_is_refused_with_its_name(tmp_path):
    src = _sglang_with(tmp_path, lambda t: t.update({"model.lm_head.weight": t.pop("lm_head.weight")}))
    with pytest.raises(ConversionError, match="model.lm_head.weight.*the head is named lm_head.weight"):
        convert(src, tmp_path / "out", to="native")


def test_one_weight_under_two_names_is_refused(tmp_path):
    src = _sglang_with(tmp_path, lambda t: t.update({"layers.0.mlp.up_proj.weight": t["midlayer.mlp.up_proj.weight"].clone()}))
    with pytest.raises(ConversionError, match="layers.0.mlp.up_proj.weight and midlayer.mlp.up_proj.weight|"
                                              "midlayer.mlp.up_proj.weight and layers.0.mlp.up_proj.weight"):
        convert(src, tmp_path / "out", to="native")


def test_embed_tokens_from_speculators_is_dropped_not_refused(tmp_path):
    spec = _speculators_draft(tmp_path, norm_before_residual=False)
    tensors = load_file(spec / "model.safetensors")
    tensors["embed_tokens.weight"] = torch.zeros(256, 32, dtype=torch.bfloat16)
    save_file(tensors, spec / "model.safetensors")
    convert(spec, tmp_path / "out", to="sglang", release="0.5.13", target_num_layers=8, target_family="deepseek_v2")
    assert "embed_tokens.weight" not in load_file(tmp_path / "out" / "model.safetensors")


def test_sliding_window_drafts_are_refused(tmp_path):
    spec = _speculators_draft(tmp_path, norm_before_residual=False)
    config = json.loads((spec / "config.json").read_text())
    config["transformer_layer_config"].update(layer_types=["sliding_attention"], sliding_window=2048)
    (spec / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConversionError, match="sliding-window attention \\(window 2048\\)"):
        convert(spec, tmp_path / "out", to="sglang", release="0.5.13", target_num_layers=8)


def test_destination_is_never_clobbered_without_overwrite(tmp_path):
    write_draft(tmp_path / "native")
    convert(tmp_path / "native", tmp_path / "out", to="sglang", release="0.5.13")
    with pytest.raises(FileExistsError, match="--overwrite"):
        convert(tmp_path / "native", tmp_path / "out", to="speculators", verifier=tiny_verifier())
    convert(tmp_path / "native", tmp_path / "out", to="speculators", overwrite=True, verifier=tiny_verifier())
    assert "speculators_config" in json.loads((tmp_path / "out" / "config.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["native", "out"]


def test_stale_duplicate_shards_are_refused(tmp_path):
    write_draft(tmp_path / "native")
    save_file({"fc.weight": torch.zeros(32, 96, dtype=torch.bfloat16)}, tmp_path / "native" / "zz-old.safetensors")
    with pytest.raises(UnreadableInput, match=r"zz-old.safetensors: tensors also stored in another file.*fc.weight"):
        convert(tmp_path / "native", tmp_path / "out", to="sglang", release="0.5.13")


def test_conflicting_target_is_refused(tmp_path):
    write_draft(tmp_path / "native")
    convert(tmp_path / "native", tmp_path / "sglang", to="sglang", release="0.5.13")
    with pytest.raises(ConversionError, match=r"target layer count given \(8\) differs from the one it was trained for \(4\)"):
        convert(tmp_path / "sglang", tmp_path / "out", to="native", target_num_layers=8)
    with pytest.raises(ConversionError, match="target family given"):
        convert(tmp_path / "sglang", tmp_path / "out", to="native", target_family="deepseek_v2")


def test_eagle_v1_is_named(tmp_path):
    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle"]}))
    save_file({"fc.weight": torch.zeros(4, 8)}, tmp_path / "eagle" / "model.safetensors")
    with pytest.raises(ConversionError, match="EAGLE \\(v1/v2\\) draft"):
        convert(tmp_path / "eagle", tmp_path / "out", to="sglang")


def test_unreadable_inputs(tmp_path):
    with pytest.raises(UnreadableInput, match="no such directory"):
        load_native(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    with pytest.raises(UnreadableInput, match="no weights"):
        load_native(tmp_path / "empty")
    (tmp_path / "empty" / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(UnreadableInput, match="corrupt safetensors"):
        load_native(tmp_path / "empty")


def test_rename_table_agrees_with_the_sglang_loader():
    for adapter in LAYOUTS.values():
        names = adapter.tensor_names(["input_norm.weight", "fc_norm.0.weight"])
        assert len(set(names.values())) == len(names)
    newest, _ = loader_rule("0.5.23")
    oldest, _ = loader_rule("0.5.11")
    flags = {"norm_before_fc", "fc_norm"}
    for canonical, name in LAYOUTS["sglang"].tensor_names(["input_norm.weight", "fc_norm.0.weight"]).items():
        assert loaded_name(name, newest, flags) == canonical  # every name we export loads where we mean it
        if not name.startswith(("input_norm", "fc_norm")):
            assert loaded_name(name, oldest, set()) == canonical
    for canonical, name in LAYOUTS["speculators"].tensor_names().items():
        assert loaded_name(name, newest, set()) == canonical
