"""`eagle3 make-target --from-gguf`: the micro target written as a GGUF file (float32, llama.cpp's layout) by the
test itself, turned back into a target directory: the same tensors, tokenizer, template and greedy output; a tied
variant stays tied; an architecture it cannot rebuild is refused by name."""

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, LlamaForCausalLM

from eagle3.cli import main
from eagle3.runtime.gguf import make_target_from_gguf, resolve_gguf
from eagle3.errors import UnreadableInput

gguf = pytest.importorskip("gguf")  # in the test extra; the import names what is missing if it is not installed

LAYER_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def interleave_rotary_halves(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q and k with each head's two rotary halves interleaved; transformers undoes it on load."""
    rows = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, rows, -1).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model: LlamaForCausalLM, tokenizer, path, architecture: str = "llama", tied: bool = False) -> None:
    config, state = model.config, {k: v.float().numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = set(tokenizer.get_added_vocab().values())  # the chat markers too, not only bos/eos/pad
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for _, i in vocab])
    writer.add_token_merges([" ".join(pair) if isinstance(pair, list) else pair for pair in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if not tied:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    for layer in range(config.num_hidden_layers):
        for ours, theirs in LAYER_NAMES.items():
            weight = state[f"model.layers.{layer}.{ours}.weight"]
            if theirs in ("attn_q", "attn_k"):
                heads = config.num_attention_heads if theirs == "attn_q" else config.num_key_value_heads
                weight = interleave_rotary_halves(weight, heads)
            writer.add_tensor(f"blk.{layer}.{theirs}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def greedy(model, tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        return_dict=True, return_tensors="pt")["input_ids"]
    return model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=[])[0].tolist()


@pytest.mark.parametrize("tied", [False, True])
def test_a_gguf_round_trips_into_a_target_directory(micro_target, tmp_path, tied):
    model, tokenizer = LlamaForCausalLM.from_pretrained(micro_target), AutoTokenizer.from_pretrained(micro_target)
    if tied:  # the head becomes the embedding, as in SmolLM2
        model.config.tie_word_embeddings = True
        model.tie_weights()
    write_gguf(model, tokenizer, tmp_path / "micro.gguf", tied=tied)

    out = make_target_from_gguf(tmp_path / "micro.gguf", tmp_path / "target", progress=lambda line: None)
    rebuilt, rebuilt_tokenizer = LlamaForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    with safe_open(out / "model.safetensors", "pt") as saved:
        assert ("lm_head.weight" in saved.keys()) is not tied  # a tied head is not written twice
        assert all(saved.get_tensor(name).dtype == torch.float32 for name in saved.keys())
    for name, tensor in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name
    assert rebuilt.config.tie_word_embeddings is tied
    text = "The for statement is used to iterate over the elements of a sequence"
    assert rebuilt_tokenizer(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert rebuilt_tokenizer.chat_template == tokenizer.chat_template
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id
    assert greedy(rebuilt, rebuilt_tokenizer, "Assignment statements") == greedy(model, tokenizer, "Assignment statements")


def test_an_architecture_it_cannot_rebuild_is_refused_by_name(micro_target, tmp_path):
    model, tokenizer = LlamaForCausalLM.from_pretrained(micro_target), AutoTokenizer.from_pretrained(micro_target)
    write_gguf(model, tokenizer, tmp_path / "other.gguf", architecture="mistral")
    with pytest.raises(UnreadableInput, match=r"architecture 'mistral' cannot be rebuilt here; supported: llama"):
        make_target_from_gguf(tmp_path / "other.gguf", tmp_path / "target", progress=lambda line: None)
    assert not (tmp_path / "target").exists()


def test_the_command_names_a_missing_file_or_package(tmp_path, capsys):
    with pytest.raises(UnreadableInput, match="no-such-model-package: neither a file nor an installed package"):
        resolve_gguf("pkg:no-such-model-package")
    assert main(["make-target", str(tmp_path / "t"), "--from-gguf", str(tmp_path / "missing.gguf")]) != 0
    assert "missing.gguf: no such GGUF file" in capsys.readouterr().err
