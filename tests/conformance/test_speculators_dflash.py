"""speculators' own DFlashDraftModel (its published release, in a child process: releases.py) on the project's DFlash
export in speculators' layout: it loads it with no edit, every parameter from the export or the verifier, and its
blocks (eager attention, a block at every anchor) equal ours."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafts import TARGET_LAYERS, TARGET_VOCAB, write_tiny_target
from eagle3.algorithms import algorithm
from eagle3.algorithms.base import ExportTarget
from eagle3.algorithms.dflash.model import DFlashConfig, DFlashDraft
from eagle3.contract.releases import SPECULATORS_RELEASE
from eagle3.model.blocks import init_weights
from eagle3.model.weights import target_verifier
from inside.speculators_loader import digest

pytestmark = pytest.mark.speculators

HIDDEN, LENGTH, BLOCK = 32, 24, 4
TOLERANCE = 1e-4
QUIET = lambda line: None  # noqa: E731


def trained_scale_dflash(target: dict[str, torch.Tensor]) -> DFlashDraft:
    """Two layers on the tiny target's head, weights at a trained draft's scale (std 0.2, norms near 1)."""
    cfg = DFlashConfig(hidden_size=HIDDEN, target_hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=HIDDEN // 4, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=512, vocab_size=TARGET_VOCAB,
                       draft_vocab_size=TARGET_VOCAB, torch_dtype="float32", aux_layers=[0, 1, 2],
                       target_num_hidden_layers=TARGET_LAYERS, target_family="llama", block_size=BLOCK,
                       mask_token_id=TARGET_VOCAB - 1)
    model = DFlashDraft(cfg, target["model.embed_tokens.weight"].float(), target["lm_head.weight"].float())
    init_weights(model, 0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=generator))
            elif param.requires_grad:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module")
def probed(tmp_path_factory, run_speculators):
    root = tmp_path_factory.mktemp("speculators-dflash")
    target_dir = write_tiny_target(root / "target")
    target = load_file(target_dir / "model.safetensors")
    model = trained_scale_dflash(target)
    entry = algorithm("dflash")
    (root / "native").mkdir()
    entry.write_draft(model.config, model.export_state(), root / "native", {})
    export = entry.export(root / "native", root / "export", "speculators",
                          ExportTarget("llama", None, TARGET_LAYERS, BLOCK - 1, target_verifier(target_dir)), QUIET)
    generator = torch.Generator().manual_seed(0)
    inputs = {"hidden_states": torch.randn(1, LENGTH, 3 * HIDDEN, generator=generator),
              "input_ids": torch.randint(0, TARGET_VOCAB - 1, (1, LENGTH), generator=generator)}
    save_file(inputs, root / "inputs.safetensors")
    answer = run_speculators(SPECULATORS_RELEASE, "speculators_dflash", {
        "draft": str(export), "inputs": str(root / "inputs.safetensors"), "outputs": str(root / "blocks.safetensors")})
    return SimpleNamespace(model=model, export=export, target=target, inputs=inputs, answer=answer,
                           blocks=load_file(root / "blocks.safetensors"))


def test_speculators_loads_every_parameter_from_the_export_or_the_verifier(probed):
    assert probed.answer["class"] == "DFlashDraftModel" and probed.answer["version"] == SPECULATORS_RELEASE
    state = probed.answer["state"]
    stored = load_file(probed.export / "model.safetensors")
    assert {name: state[name] for name in stored} == {name: digest(t) for name, t in stored.items()}
    from_verifier = {"embed_tokens.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight",
                     "verifier_norm.weight": "model.norm.weight", "verifier_lm_head.weight": "lm_head.weight"}
    rest = {name: state[name] for name in set(state) - set(stored)}
    assert set(rest) <= set(from_verifier), sorted(rest)  # nothing of the draft left at its initialisation
    for name, digested in rest.items():
        assert digested == digest(probed.target[from_verifier[name]].to(getattr(torch, digested[0]))), name


def test_its_blocks_equal_ours(probed):
    anchors = probed.blocks["anchors"]
    assert anchors.tolist() == list(range(LENGTH - BLOCK))
    with torch.no_grad():
        model = probed.model
        first = probed.inputs["input_ids"][:, anchors]
        hidden = model.blocks(model.context(probed.inputs["hidden_states"]), first, anchors[None])  # [1, N, Bk, H]
        ours = hidden[0] @ model.lm_head.T
        shifted = model.blocks(model.context(probed.inputs["hidden_states"]), first, anchors[None] + 1)[0] @ model.lm_head.T
    theirs = probed.blocks["logits"]
    assert theirs.shape == ours.shape and (ours - theirs).abs().max().item() < TOLERANCE
    assert (shifted - theirs).abs().max().item() > 100 * TOLERANCE  # one position off is far outside it
