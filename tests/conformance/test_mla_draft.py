"""SGLang 0.5.23's own MLA draft (Eagle3DeepseekV2ForCausalLM, models/kimi_k25_eagle3.py) loading our MLA exports on
the CPU (inside/mla_draft.py): every tensor consumed, every parameter written, and its forward over a prefix, made
from the weights its loader produced (absorbed MLA, its fused down projection and split kv_b_proj), equal to ours.
Two drafts: our export (interleaved RoPE, the EAGLE 3.1 norms it serves) and one written the way public MLA drafts
are stored (`layers.0.*`, no record of ours, halves-style RoPE), which validate passes and convert reads.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafts import MLA, write_draft
from eagle3.algorithms.eagle3.checkpoint import convert, load_native
from eagle3.algorithms.eagle3.layouts.shared import PROVENANCE_KEY
from eagle3.algorithms.eagle3.validate import validate
from eagle3.model.blocks import causal_mask
from eagle3.algorithms.eagle3.served import draft_as_served, draft_from_native

RELEASE = "0.5.23"
LENGTH, VOCAB, HIDDEN = 9, 256, 32
FAMILY = "deepseek_v2"  # an MLA target's family: the aux ids are encoded under its +1 rule
TARGET = dict(target_family=FAMILY, target_num_hidden_layers=6, aux_layers=[1, 2, 3])


def public_layout(export, into):
    """An MLA draft as published drafts store it: the layer under layers.0, no provenance of ours, neox RoPE."""
    shutil.copytree(export, into)
    config = json.loads((into / "config.json").read_text())
    config.pop(PROVENANCE_KEY)
    config["rope_interleave"] = False
    (into / "config.json").write_text(json.dumps(config))
    tensors = load_file(into / "model.safetensors")
    save_file({name.replace("midlayer.", "layers.0.", 1): t for name, t in tensors.items()}, into / "model.safetensors")
    return into


@pytest.fixture(scope="module")
def loaded(run_sglang, tmp_path_factory):
    root = tmp_path_factory.mktemp("mla")
    ours = write_draft(root / "ours", layout="sglang", release=RELEASE, fc_norm=True, norm_output=True,
                       **TARGET, **MLA)
    drafts = {"ours": ours, "public": public_layout(ours, root / "public")}
    generator = torch.Generator().manual_seed(0)
    inputs = {"aux": torch.randn(LENGTH, 3 * HIDDEN, generator=generator),
              "ids": torch.randint(0, VOCAB, (LENGTH,), generator=generator),
              "embed": torch.randn(VOCAB, HIDDEN, generator=generator)}
    answer = run_sglang(RELEASE, "mla_draft", {"drafts": {k: str(v) for k, v in drafts.items()},
                                               "inputs": {k: v.tolist() for k, v in inputs.items()}})
    return drafts, inputs, answer["drafts"]


@pytest.mark.parametrize("draft", ["ours", "public"])
def test_sglang_loads_every_tensor_and_writes_every_parameter(loaded, draft):
    _, _, answers = loaded
    load = answers[draft]["load"]
    assert "error" not in load, load.get("error")
    assert load["facts"]["class"] == "Eagle3DeepseekV2ForCausalLM" and load["facts"]["has_fc_norm"]
    unwritten = [name for name, state in load["written"].items() if not state["written"]]
    assert unwritten == ["model.embed_tokens.weight"]  # SGLang hands the draft the target's embedding
    dropped = [name for name, landed in load["sources"].items() if not landed]
    assert sorted(dropped) == ["d2t", "t2d"]  # d2t becomes hot_token_id; t2d is not read
    fused = load["sources"]["midlayer.self_attn.q_a_proj.weight" if draft == "ours" else "layers.0.self_attn.q_a_proj.weight"]
    assert fused[0]["param"] == "model.midlayer.self_attn.fused_qkv_a_proj_with_mqa.weight"


def as_read(path, embed, tmp_path):
    """The draft as this project reads it: converted with the target's family and layer count (a public draft
    records neither)."""
    native = convert(path, tmp_path / "native", to="native", target_family=FAMILY, release=RELEASE,
                     target_num_layers=TARGET["target_num_hidden_layers"])
    return draft_from_native(load_native(native), embed).eval()


@pytest.mark.parametrize("draft", ["ours", "public"])
def test_sglangs_forward_from_its_loaded_weights_equals_ours(loaded, draft, tmp_path):
    drafts, inputs, answers = loaded
    model = as_read(drafts[draft], inputs["embed"], tmp_path)
    assert model.hot_token_ids().tolist() == answers[draft]["load"]["hot_token_id"]
    with torch.no_grad():
        hidden = model.fuse(inputs["aux"][None])
        q, k, v = model.project(inputs["ids"][None], hidden, torch.arange(LENGTH))
        carried, logits = model.finish(hidden, model.midlayer.self_attn.attend(q, k, v, causal_mask(LENGTH)))
    theirs = answers[draft]
    torch.testing.assert_close(logits[0], torch.tensor(theirs["logits"]), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(carried[0], torch.tensor(theirs["carried"]), atol=1e-5, rtol=1e-5)


def test_a_public_mla_draft_validates_and_converts_with_every_weight_in_place(loaded, tmp_path):
    drafts, inputs, _ = loaded
    report = validate(drafts["public"], release=RELEASE, target_family=FAMILY)
    assert report.ok, [p.message for p in report.of("error")]
    public, ours = as_read(drafts["public"], inputs["embed"], tmp_path / "public"), draft_as_served(
        drafts["ours"], RELEASE, inputs["embed"])
    assert public.config.attention == "mla" and not public.config.rope_interleave
    assert public.config.flags() == ["fc_norm", "norm_output"] and public.config.aux_layers == [1, 2, 3]
    for name, tensor in ours.state_dict().items():
        if name != "t2d":  # SGLang does not read it, nor does draft_as_served
            assert torch.equal(tensor, public.state_dict()[name]), name
