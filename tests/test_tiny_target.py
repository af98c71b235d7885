import dataclasses
import math
import time

import pytest

import torch
from fixtures_tiny import one_torch_thread
from transformers import AutoModelForCausalLM, AutoTokenizer

from eagle3.runtime.tiny import MICRO, build_tiny_target, corpus_ids, heldout_loss, tiny_model
from eagle3.errors import Eagle3Error
from eagle3.records.manifest import read_manifest

# Contents end in a space and a newline, where a merge across the turn boundary would show.
CONVERSATION = [
    {"role": "user", "content": "What does assert do? "},
    {"role": "assistant", "content": "It raises AssertionError:\n"},
]


def test_loads_with_plain_auto_classes(micro_target):
    model = AutoModelForCausalLM.from_pretrained(micro_target)
    tokenizer = AutoTokenizer.from_pretrained(micro_target)
    assert model.config.vocab_size == MICRO.vocab_size and not model.config.tie_word_embeddings
    assert tokenizer.eos_token == "<|end|>" and tokenizer.bos_token == "<|bos|>" and tokenizer.pad_token == "<|pad|>"
    assert model.config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert read_manifest(micro_target)["kind"] == "tiny-target"


def test_chat_template_ends_every_turn_with_end(micro_target):
    tokenizer = AutoTokenizer.from_pretrained(micro_target)
    text = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|bos|><|user|>\nWhat does assert do? <|end|>\n"
        "<|assistant|>\nIt raises AssertionError:\n<|end|>\n<|assistant|>\n"
    )


def test_conversation_tokens_are_the_concatenation_of_its_turns(micro_target):
    tokenizer = AutoTokenizer.from_pretrained(micro_target)
    pieces = ["<|bos|>"] + [f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in CONVERSATION]
    per_turn = [token for piece in pieces for token in tokenizer.encode(piece, add_special_tokens=False)]
    whole = tokenizer.apply_chat_template(CONVERSATION, return_dict=True)["input_ids"]
    assert whole == per_turn
    assert whole.count(tokenizer.eos_token_id) == len(CONVERSATION)


def held_out_loss(model, tokenizer) -> float:
    return heldout_loss(model, corpus_ids(tokenizer), MICRO.seq_len)


def test_trained_model_predicts_held_out_text_far_better_than_chance(micro_target):
    tokenizer = AutoTokenizer.from_pretrained(micro_target)
    trained = held_out_loss(AutoModelForCausalLM.from_pretrained(micro_target), tokenizer)
    torch.manual_seed(0)
    untrained = held_out_loss(tiny_model(MICRO, tokenizer), tokenizer)
    assert trained < 0.75 * math.log(MICRO.vocab_size)
    assert trained < untrained - 1.0


def test_same_inputs_reuse_the_cache_and_a_changed_recipe_rebuilds(tmp_path):
    quick, out, lines = dataclasses.replace(MICRO, max_steps=5, max_heldout_loss=100.0), tmp_path / "target", []
    with one_torch_thread():
        build_tiny_target(out, quick, progress=lines.append)
        first = read_manifest(out)
        assert first["steps"] == 5 and first["recipe"] == dataclasses.asdict(quick)

        start = time.perf_counter()
        build_tiny_target(out, quick, progress=lines.append)
        assert time.perf_counter() - start < 2.0
        assert "reusing the cached" in lines[-1] and read_manifest(out) == first

        build_tiny_target(out, dataclasses.replace(quick, seed=1), progress=lines.append)
    rebuilt = read_manifest(out)
    assert rebuilt["content_hash"] != first["content_hash"] and rebuilt["recipe"]["seed"] == 1
    assert not list(tmp_path.glob(".target.*"))  # no temporary siblings left behind


def test_the_build_is_bound_by_steps_and_gives_the_same_weights_every_time(micro_target, tmp_path):
    """The session's micro target and a second build agree bit for bit: same steps, same weights hash."""
    first = read_manifest(micro_target)
    assert first["steps"] == MICRO.max_steps and first["stopped_by"] == "step budget (max_steps)"
    assert first["heldout_loss"] <= MICRO.max_heldout_loss
    with one_torch_thread():
        build_tiny_target(tmp_path / "again", MICRO, progress=lambda line: None)
    again = read_manifest(tmp_path / "again")
    assert again["files"]["model.safetensors"]["sha256"] == first["files"]["model.safetensors"]["sha256"]


def test_a_target_above_its_loss_bar_is_refused_and_not_published(tmp_path):
    starved = dataclasses.replace(MICRO, max_steps=5)  # what a build stopped early by a loaded machine used to be
    with one_torch_thread(), pytest.raises(Eagle3Error, match=r"micro target's held-out loss is \d\.\d+ after 5 steps .*"
                                                                r"above its bar 4.0: it would answer with degenerate text"):
        build_tiny_target(tmp_path / "target", starved, progress=lambda line: None)
    assert not (tmp_path / "target").exists() and not list(tmp_path.iterdir())
