"""A Kimi-kind target built by the tests: what Kimi-K2 / K2.5 ship instead of a tokenizer.json, at micro size.

- `tiktoken.model`: a byte-level BPE (base64 token, rank per line), its ranks trained here on pydoc's topics;
- `tokenization_kimi.py`: a `TikTokenTokenizer(PreTrainedTokenizer)` on the `tiktoken` package, our own code
  written by this module, named through `auto_map` in tokenizer_config.json, so transformers runs it only with
  trust_remote_code. Like Kimi's, it reserves 256 special ids after the BPE's ranks ([BOS], [EOS], the chat markers
  <|im_end|>, <|im_user|>, <|im_assistant|>, <|im_system|>, <|im_middle|>, the rest <|reserved_token_i|>), plus two
  more for <think> and </think>;
- `chat_template.jinja`: Kimi's markers, switched by `thinking` (Moonshot's name), `<think>` opening the reply and
  the assistant's reasoning_content rendered inside <think>…</think>;
- a small Llama model on that vocabulary, trained with the tiny target's loop (eagle3/runtime/tiny.py) so a draft
  has something to learn; `tie_word_embeddings` is a parameter.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

import eagle3.runtime.tiny
from eagle3.runtime.tiny import HELD_OUT_TOKENS, MAX_POSITIONS, MICRO, corpus_text, heldout_loss, train
from fixtures_tiny import build_key, once_per_session

BPE_SIZE = 512  # the ranks: 256 bytes and the merges
NUM_RESERVED = 256
EXTRA_SPECIALS = ("<think>", "</think>")  # the +2 after the 256 reserved
VOCAB_SIZE = BPE_SIZE + NUM_RESERVED + len(EXTRA_SPECIALS)
# Kimi's offsets of its named specials among the reserved ids
NAMED_SPECIALS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>", 9: "[EOT]",
                  10: "<|im_system|>", 17: "<|im_middle|>"}
END_OF_TURN_ID = BPE_SIZE + 2  # <|im_end|>

TOKENIZER_CODE = '''"""TikTokenTokenizer: a tiktoken BPE (tiktoken.model) with reserved special ids after its ranks, in the
manner of Kimi's tokenization_kimi.py (written by the eagle3 tests)."""

import base64
from pathlib import Path

import tiktoken
from transformers import AddedToken
from transformers.tokenization_utils import PreTrainedTokenizer

PAT_STR = r"""PATTERN"""
NUM_RESERVED = NUM_RESERVED_VALUE
EXTRA_SPECIALS = EXTRA_SPECIALS_VALUE
NAMED_SPECIALS = NAMED_SPECIALS_VALUE


def read_ranks(path):
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, bos_token="[BOS]", eos_token="<|im_end|>", pad_token="[EOS]", **kwargs):
        ranks = read_ranks(vocab_file)
        base = len(ranks)
        names = [NAMED_SPECIALS.get(i, f"<|reserved_token_{i}|>") for i in range(NUM_RESERVED)] + list(EXTRA_SPECIALS)
        self.special_ids = {name: base + i for i, name in enumerate(names)}
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=PAT_STR, mergeable_ranks=ranks,
                                       special_tokens=self.special_ids)
        # tokens as text: each byte one latin-1 character, so every token is a distinct str and joins back to bytes
        self.decoder = {rank: token.decode("latin-1") for token, rank in ranks.items()}
        self.encoder = {text: rank for rank, text in self.decoder.items()}
        self._added_tokens_decoder = {i: AddedToken(name, special=True, normalized=False)
                                      for name, i in self.special_ids.items()}
        kwargs.pop("added_tokens_decoder", None)
        super().__init__(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, **kwargs)

    @property
    def vocab_size(self):
        return self.model.n_vocab

    def get_vocab(self):
        return {**self.encoder, **self.special_ids}

    def _tokenize(self, text, **kwargs):
        return [self.decoder[i] for i in self.model.encode_ordinary(text)]

    def _convert_token_to_id(self, token):
        return self.encoder[token] if token in self.encoder else self.special_ids[token]

    def _convert_id_to_token(self, index):
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens).encode("latin-1").decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|><think>{{ message.get('reasoning_content', '') }}</think>"
    "{%- endif -%}"
    "{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|><think>"
    "{%- if not thinking -%}</think>{%- endif -%}{%- endif -%}"
)


def byte_of_char() -> dict[str, int]:
    """The inverse of the byte-level alphabet (GPT-2's printable stand-in for each byte) that tokenizers' BPE uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def train_ranks(text: str) -> dict[bytes, int]:
    """BPE ranks for tiktoken: byte-level merges learnt with `tokenizers` (rank = the order a token was made in,
    which is the order tiktoken merges by)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator([text], trainer=trainers.BpeTrainer(
        vocab_size=BPE_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    to_byte = byte_of_char()
    vocab = sorted(bpe.get_vocab().items(), key=lambda item: item[1])
    return {bytes(to_byte[c] for c in token): rank for token, rank in vocab}


def write_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    path.write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items()))


def write_tokenizer(out: Path) -> None:
    write_ranks(out / "tiktoken.model", train_ranks(corpus_text()))
    code = (TOKENIZER_CODE.replace("PATTERN", GPT2_PATTERN).replace("NUM_RESERVED_VALUE", str(NUM_RESERVED))
            .replace("EXTRA_SPECIALS_VALUE", repr(EXTRA_SPECIALS)).replace("NAMED_SPECIALS_VALUE", repr(NAMED_SPECIALS)))
    (out / "tokenization_kimi.py").write_text(code)
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer", "bos_token": "[BOS]", "eos_token": "<|im_end|>",
        "pad_token": "[EOS]", "model_max_length": MAX_POSITIONS}, indent=1))


def build_kimi_target(out: Path, tie_word_embeddings: bool = False) -> Path:
    """The whole target directory (tokenizer files, config, weights) in `out`; ~15 s on one core."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)
    recipe = dataclasses.replace(MICRO, name="kimi-micro", vocab_size=VOCAB_SIZE)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=END_OF_TURN_ID, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(recipe.seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, max_position_embeddings=MAX_POSITIONS, rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings, **special))
    model.generation_config = GenerationConfig(do_sample=False, **special)
    ids = torch.tensor(tokenizer(corpus_text(), add_special_tokens=False)["input_ids"])  # [tokens]
    train(model, ids[:-HELD_OUT_TOKENS], recipe, progress=lambda line: None)
    loss = heldout_loss(model, ids, recipe.seq_len)
    assert loss < recipe.max_heldout_loss, f"the Kimi-kind test target learnt too little (held-out loss {loss:.2f})"
    model.save_pretrained(out)
    return out


def write_k25_config(out: Path, layers: int, hidden: int, vocab: int) -> Path:
    """K2.5's config.json layout (no weights): the language model nested in text_config, model_type kimi_k25, its
    configuration code named through auto_map."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "configuration_kimi_k25.py").write_text("# K2.5's configuration code would be here\n")
    (out / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config"},
        "text_config": {"model_type": "kimi_k2", "num_hidden_layers": layers, "hidden_size": hidden,
                        "vocab_size": vocab, "torch_dtype": "bfloat16"}}))
    return out


@pytest.fixture(scope="session")
def kimi_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Kimi-kind target, built once per session with its head tied to its embedding (as SmolLM2, Qwen2.5-0.5B
    or Llama-3.2-1B: the flow test proves both kinds of real target at once)."""
    key = build_key("tie_word_embeddings=True", sys.modules[__name__], eagle3.runtime.tiny)
    return once_per_session(tmp_path_factory, "kimi-target", key,
                            lambda out: build_kimi_target(out, tie_word_embeddings=True))
