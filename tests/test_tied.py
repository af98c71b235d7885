"""Targets whose head is their embedding (tie_word_embeddings, as SmolLM2, Qwen2.5-0.5B and Llama-3.2-1B): the head
the draft learns from, and errors that name the real cause when a target's files lack a head. The whole flow on a
tied target: test_flow.py."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from eagle3.errors import UnreadableInput
from eagle3.model.teacher import TeacherHead
from eagle3.model.weights import target_embedding, target_head, tied_head

VOCAB, HIDDEN = 64, 32


def save_llama(directory, tied: bool):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


def rewrite_tensors(directory, change) -> None:
    tensors = load_file(directory / "model.safetensors")
    save_file(change(tensors), directory / "model.safetensors", metadata={"format": "pt"})


def test_a_tied_target_stores_no_head_and_the_teacher_uses_its_embedding(tmp_path):
    model = save_llama(tmp_path, tied=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")  # what SmolLM2's files look like
    head = target_head(tmp_path)
    assert torch.equal(head["lm_head"], head["embed"]) and torch.equal(target_embedding(tmp_path), head["embed"])
    ids = torch.randint(0, VOCAB, (2, 12))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    teacher = TeacherHead(head["lm_head"], torch.arange(8))(out.hidden_states[-1])  # after the final norm
    assert torch.equal(teacher.argmax, out.logits.argmax(-1))


def test_the_tie_is_read_from_a_nested_text_config_first(tmp_path):
    save_llama(tmp_path, tied=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False,
                                                      # a multimodal config nests the whole language model there
                                                      "text_config": {**config, "tie_word_embeddings": True}}))
    assert tied_head(tmp_path)
    assert torch.equal(target_head(tmp_path)["lm_head"], target_head(tmp_path)["embed"])


def test_a_tied_target_storing_its_embedding_as_head_is_read_and_another_head_is_refused(tmp_path):
    save_llama(tmp_path, tied=True)
    rewrite_tensors(tmp_path, lambda t: {**t, "lm_head.weight": t["model.embed_tokens.weight"].clone()})
    assert torch.equal(target_head(tmp_path)["lm_head"], target_head(tmp_path)["embed"])
    rewrite_tensors(tmp_path, lambda t: {**t, "lm_head.weight": torch.randn(VOCAB, HIDDEN)})
    with pytest.raises(UnreadableInput, match="ties the head to the embedding .* SGLang would serve the embedding"):
        target_head(tmp_path)


def test_an_untied_target_without_a_head_names_the_cause_and_the_prefix_only_where_one_exists(tmp_path):
    save_llama(tmp_path, tied=False)
    rewrite_tensors(tmp_path, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
    with pytest.raises(UnreadableInput) as missing:
        target_head(tmp_path)
    assert "does not tie the head" in str(missing.value) and "weight_prefix" not in str(missing.value)
    rewrite_tensors(tmp_path, lambda t: {"language_model." + k: v for k, v in t.items()})
    with pytest.raises(UnreadableInput, match="set target.weight_prefix to 'language_model.'"):
        target_head(tmp_path)
