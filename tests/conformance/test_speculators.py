"""speculators' own loader and EAGLE-3 forward (its published release, run in a child process with the transformers
it allows: releases.py) on the project's speculators export as `eagle3 convert --to speculators --target DIR`
writes it: it loads with no edit, every tensor from the export or the verifier, ten loads alike, and its forward
equals Eagle3Draft's. The faults `eagle3 validate --loader speculators` refuses make its loader fail."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafts import TARGET_VOCAB, tiny_draft, write_tiny_target
from eagle3.cli import main
from eagle3.algorithms.eagle3.checkpoint import load_native, save_native_draft
from eagle3.contract.releases import SPECULATORS_RELEASE
from eagle3.algorithms.eagle3.validate import validate
from eagle3.algorithms.eagle3.ttt import shift_left, ttt_forward
from eagle3.algorithms.eagle3.served import draft_from_native
from inside.speculators_loader import digest

pytestmark = pytest.mark.speculators

LOADS, STEPS = 10, 3
LENGTH = 128  # one flex-attention block: its TTT mask extension works on whole blocks
HIDDEN, NUM_AUX = 32, 3
TOLERANCE = 1e-5


def trained_scale_draft():
    """tiny_draft with weights at a trained draft's scale (std 0.2, norms near 1): logits of a few units. With the
    std-1 weights of tiny_draft the logits reach ~25 and float32 summation order alone differs by ~6e-5."""
    draft = tiny_draft()
    for name, tensor in draft.tensors.items():
        if tensor.is_floating_point():
            scaled = 1 + 0.1 * tensor.float() if name.endswith("norm.weight") else 0.2 * tensor.float()
            draft.tensors[name] = scaled.to(tensor.dtype)
    return draft


def _verifier(name):
    return lambda c: c["speculators_config"]["verifier"].update(name_or_path=name)


# fault -> (config change given the fixture root, the code validate refuses it with)
FAULTS = {
    "no-verifier": (lambda root: _verifier(None), "verifier"),
    "wider-verifier": (lambda root: _verifier(str(write_tiny_target(root / "wide", hidden=2 * HIDDEN))), "verifier"),
    "both-input-norms": (lambda root: lambda c: c.update(norm_before_fc=True, fc_norm=True), "speculators-config"),
    "mistral-layer": (lambda root: lambda c: c["transformer_layer_config"].update(model_type="mistral"),
                      "speculators-config"),
    "ids-past-the-target": (lambda root: lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]),
                            "aux-ids-invalid"),
}


def derive(export: Path, into: Path, change) -> Path:
    shutil.copytree(export, into)
    config = json.loads((into / "config.json").read_text())
    change(config)
    (into / "config.json").write_text(json.dumps(config))
    return into


@pytest.fixture(scope="module")
def probed(tmp_path_factory, run_speculators):
    root = tmp_path_factory.mktemp("speculators")
    target = write_tiny_target(root / "target")
    native = save_native_draft(trained_scale_draft(), root / "native", to="native")
    export = root / "export"
    assert main(["convert", str(native), str(export), "--to", "speculators", "--target", str(target)]) == 0
    drafts = {"export": export, **{name: derive(export, root / name, change(root))
                                   for name, (change, _) in FAULTS.items()}}
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TARGET_VOCAB, (1, LENGTH), generator=generator)  # x_0 .. x_{T-1}
    aux = torch.randn(1, LENGTH, NUM_AUX * HIDDEN, generator=generator)
    # speculators' step 0 reads the token after each position, as ours does: x_{t+1} beside the features of t
    save_file({"hidden_states": aux, "input_ids": shift_left(tokens, 1)}, root / "inputs.safetensors")
    job = {"drafts": {name: str(path) for name, path in drafts.items()}, "loads": LOADS,
           "forward": {"draft": "export", "inputs": str(root / "inputs.safetensors"),
                       "outputs": str(root / "logits.safetensors"), "steps": STEPS}}
    answer = run_speculators(SPECULATORS_RELEASE, "speculators_loader", job)
    return SimpleNamespace(target=target, drafts=drafts, tokens=tokens, aux=aux, answer=answer,
                           logits=load_file(root / "logits.safetensors"))


def test_the_export_names_the_release_and_class_speculators_has(probed):
    config = json.loads((probed.drafts["export"] / "config.json").read_text())
    result = probed.answer["drafts"]["export"]
    assert "raised" not in result, result
    assert probed.answer["version"] == config["speculators_version"] == SPECULATORS_RELEASE
    assert result["class"] == config["architectures"][0]


def test_ten_loads_hold_the_same_weights_each_from_the_export_or_the_verifier(probed):
    loads = probed.answer["drafts"]["export"]["loads"]
    assert len(loads) == LOADS and all(state == loads[0] for state in loads[1:])
    stored = load_file(probed.drafts["export"] / "model.safetensors")
    target = load_file(probed.target / "model.safetensors")
    from_verifier = {"verifier_lm_head.weight": target["lm_head.weight"][stored["t2d"]],  # the teacher, draft rows
                     "verifier_norm.weight": target["model.norm.weight"]}
    # strict: no tensor of the export left out, no parameter filled from anywhere else
    assert loads[0] == {name: digest(t) for name, t in {**stored, **from_verifier}.items()}


def test_its_forward_equals_ours(probed):
    ours = draft_from_native(load_native(probed.drafts["export"]),
                             load_file(probed.target / "model.safetensors")["model.embed_tokens.weight"].float())
    with torch.no_grad():
        logits = ttt_forward(ours.eval(), probed.aux, probed.tokens, STEPS)
        misaligned = ttt_forward(ours, probed.aux, shift_left(probed.tokens, 1), STEPS)
    assert len(probed.logits) == STEPS
    for step, ours_k in enumerate(logits):
        theirs = probed.logits[f"step{step}"]
        assert (ours_k - theirs).abs().max().item() < TOLERANCE, f"TTT step {step}"
        # the comparison can fail: one token of misalignment is far outside it
        assert (misaligned[step] - theirs).abs().max().item() > 1000 * TOLERANCE


@pytest.mark.parametrize("fault", FAULTS)
def test_what_validate_refuses_its_loader_refuses(probed, fault):
    assert "raised" in probed.answer["drafts"][fault], f"speculators loaded {fault}"
    report = validate(probed.drafts[fault], engine="speculators")
    assert FAULTS[fault][1] in {p.code for p in report.of("error")}, (probed.answer["drafts"][fault], report)
    assert validate(probed.drafts["export"], engine="speculators").ok
