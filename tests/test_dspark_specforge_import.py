"""A DSpark draft as SpecForge 0.2.0 exports it (`DSparkDraftModel`, q/k/v unstacked, the heads' fields in
`dflash_config`, and only the fields its user set: no `enable_confidence_head` unless set, whose default there is no
head, and no `confidence_head_with_markov`, whose default there is False) imports as the draft it is: the confidence
head's presence and width read off its tensors (docs/algorithms.md, "DSpark"; benchmarks/vs_specforge.py --draft
dspark imports SpecForge's trained draft this way)."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3.algorithms import algorithm, draft_algorithm
from eagle3.algorithms.dspark.layout import read_sglang, write_sglang
from eagle3.algorithms.dspark.model import DSparkConfig, DSparkDraft
from eagle3.model.blocks import init_weights
from eagle3.validation.external import Serving

pytestmark = pytest.mark.usefixtures("one_thread")
QUIET = lambda line: None  # noqa: E731
HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
               "sample_from_anchor")


def tiny_dspark(confidence_head: bool, with_markov: bool, vocab=40, hidden=32) -> DSparkDraft:
    cfg = DSparkConfig(hidden_size=hidden, target_hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=256, vocab_size=vocab, draft_vocab_size=16,
                       torch_dtype="float32", aux_layers=[0, 1, 2], target_num_hidden_layers=5, target_family="llama",
                       block_size=3, mask_token_id=vocab - 1, markov_rank=8, confidence_head=confidence_head,
                       confidence_head_with_markov=with_markov, ce_weight=0.1, l1_weight=0.9, confidence_weight=1.0)
    generator = torch.Generator().manual_seed(0)
    model = DSparkDraft(cfg, torch.randn(vocab, hidden, generator=generator),
                        torch.randn(vocab, hidden, generator=generator))
    init_weights(model, 0)
    return model.eval()


def as_specforge(model: DSparkDraft, tmp_path: Path) -> Path:
    """Our SGLang export rewritten as SpecForge's HF exporter writes a DSpark draft: its architecture, the heads' fields
    nested in dflash_config as its user gave them (rank and type), none at the top level, no record of ours."""
    native = tmp_path / "native"
    native.mkdir()
    algorithm("dspark").write_draft(model.config, model.export_state(), native, {})
    ours = write_sglang(native, tmp_path / "sglang")
    raw = json.loads((ours / "config.json").read_text())
    for name in ("eagle3", "dspark_config", *HEAD_FIELDS):
        raw.pop(name, None)
    raw["architectures"] = ["DSparkDraftModel"]
    raw["dflash_config"] = {"target_layer_ids": model.config.aux_layers, "mask_token_id": model.config.mask_token_id,
                            "markov_rank": model.config.markov_rank, "markov_head_type": "vanilla",
                            "attention_mode": "gqa", "projector_type": "dspark"}
    source = tmp_path / "specforge"
    source.mkdir()
    (source / "config.json").write_text(json.dumps(raw))
    save_file(load_file(ours / "model.safetensors"), source / "model.safetensors")
    return source


@pytest.mark.parametrize("confidence_head, with_markov", [(True, False), (True, True), (False, False)])
def test_a_specforge_dspark_export_imports_with_the_confidence_head_its_tensors_hold(tmp_path, confidence_head,
                                                                                     with_markov):
    model = tiny_dspark(confidence_head, with_markov)
    source = as_specforge(model, tmp_path)
    serving = Serving(family="llama", release="0.5.23", num_layers=5, vocab_size=40, data_layers=[0, 1, 2],
                      context_length=128, num_steps=3)
    lines = []
    done = draft_algorithm(source).convert_external(source, tmp_path / "imported", serving, lines.append)
    cfg, tensors = read_sglang(tmp_path / "imported")
    assert (cfg.confidence_head, cfg.confidence_head_with_markov) == (confidence_head, with_markov)
    assert (cfg.block_size, cfg.markov_rank, cfg.aux_layers) == (3, 8, [0, 1, 2])
    assert {name: t.tolist() for name, t in tensors.items()} == {
        name: t.tolist() for name, t in model.export_state().items()}
    assert done.draft["dspark"]["confidence_head"] is confidence_head
    said = [line for line in lines if "no enable_confidence_head" in line or "no confidence_head_with_markov" in line]
    assert len(said) == 2
    served = json.loads((tmp_path / "imported" / "config.json").read_text())  # where SGLang and vLLM read them
    assert (served["enable_confidence_head"], served["confidence_head_with_markov"]) == (confidence_head, with_markov)
