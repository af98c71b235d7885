"""The project's own tiny target: a byte-level BPE and a small Llama (or another family SGLang serves with EAGLE-3:
Qwen2, Qwen3, Qwen3-MoE, Gemma 3, DeepSeek-V2) trained on Python's reference manual.

A real target needs a GPU, and a random-init one gives a draft nothing to learn (docs/pipeline.md). This one
trains in minutes on two CPU cores and its greedy continuations read like the manual, so draft accuracy
and acceptance mean something in tests and demos.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from pydoc_data.topics import topics
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
import transformers
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

from eagle3.errors import Eagle3Error
from eagle3.records.manifest import MANIFEST_FILE, read_manifest, write_manifest
from eagle3.fsutil import atomic_directory

BOS, END, PAD = "<|bos|>", "<|end|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, END, "<|user|>", "<|assistant|>", "<|system|>", PAD]
# Every turn ends with the special token <|end|>. Special tokens split tokenization, so the tokens of a
# conversation are the concatenation of the tokens of its per-turn pieces: the data stage relies on that.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
MAX_POSITIONS = 2048


@dataclass(frozen=True)
class ChatMarkup:
    """A family's chat form, as its published tokenizers write it: the special tokens, the BOS (None: the family has
    none), the token a turn ends with (generation stops on it), the padding token, and the chat template."""

    special_tokens: tuple[str, ...]
    bos: str | None
    end: str
    pad: str
    template: str


PROJECT_CHAT = ChatMarkup(tuple(SPECIAL_TOKENS), BOS, END, PAD, CHAT_TEMPLATE)
_CHATML_TURNS = ("{% for message in messages %}"
                 "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}")
_CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN2_CHAT = ChatMarkup(_CHATML_SPECIALS, None, "<|im_end|>", "<|endoftext|>",
                        _CHATML_TURNS + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Qwen3 thinks unless enable_thinking is false, which opens the reply with an empty think block
QWEN3_CHAT = ChatMarkup(_CHATML_SPECIALS, None, "<|im_end|>", "<|endoftext|>", _CHATML_TURNS + (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"))
# Gemma: a BOS, turns between <start_of_turn> and <end_of_turn>, the assistant's role named `model`
GEMMA3_CHAT = ChatMarkup(("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"), "<bos>", "<end_of_turn>",
                         "<pad>", (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' "
    "+ message['content'] + '<end_of_turn>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"))
FAMILY_CHAT = {"llama": PROJECT_CHAT, "qwen2": QWEN2_CHAT, "qwen3": QWEN3_CHAT, "qwen3_moe": QWEN3_CHAT,
               "gemma3": GEMMA3_CHAT, "deepseek_v2": PROJECT_CHAT}
HELD_OUT_TOKENS = 4096  # the corpus tail is never trained on, so it can measure what the model learned
WARMUP_STEPS = 20
LOSS_WINDOW = 10  # the reported final loss averages the last steps: one batch's loss is noisy


# What each family adds to a shape (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, ... as transformers names them), given its head size. Every family keeps
# its own form: Qwen3's per-head q/k norms, Qwen3-MoE's routed experts, Gemma 3's tied head, sandwich norms and
# sliding-window layers, DeepSeek-V2's MLA attention, dense first layer and routed + shared experts.
def _heads(shape: dict, head_dim: int) -> dict:
    return {"head_dim": head_dim}  # Qwen3 and Gemma 3 would default to 128 / 256


def _qwen3_moe(shape: dict, head_dim: int) -> dict:
    return {"head_dim": head_dim, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
            "moe_intermediate_size": shape["intermediate_size"] // 2}


def _gemma3(shape: dict, head_dim: int) -> dict:
    return {"head_dim": head_dim, "query_pre_attn_scalar": head_dim, "tie_word_embeddings": True, "sliding_window": 32}


def _deepseek_v2(shape: dict, head_dim: int) -> dict:
    """Every head attends over one shared latent (as many kv heads as heads). Beside transformers' fields: the ones
    SGLang's deepseek_v2.py reads that transformers' config lacks (moe_layer_freq, scoring_func), and YaRN rope
    scaling (its CPU rotary embedding asserts one), as DeepSeek's own configs carry them."""
    return {"kv_lora_rank": 2 * head_dim, "q_lora_rank": None, "qk_nope_head_dim": head_dim,
            "qk_rope_head_dim": head_dim // 2, "v_head_dim": head_dim, "num_key_value_heads": shape["num_attention_heads"],
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "moe_intermediate_size": shape["intermediate_size"] // 2, "moe_layer_freq": 1, "n_group": 1,
            "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "routed_scaling_factor": 1.0,
            "rope_scaling": {"type": "yarn", "rope_type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                             "original_max_position_embeddings": shape["max_position_embeddings"] // 4,
                             "mscale": 1.0, "mscale_all_dim": 1.0}}


# family (SGLang's model file) -> transformers' config and model classes, and what the family adds to a shape
FAMILY_ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _heads),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _heads),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", _heads),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _qwen3_moe),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", _gemma3),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", _deepseek_v2),
}


def family_model(family: str, **shape) -> PreTrainedModel:
    """A randomly initialised model of `family` with `shape` (what the family adds goes over it)."""
    config_class, model_class, added = FAMILY_ARCHITECTURES[family]
    fields = {**shape, **added(shape, shape["hidden_size"] // shape["num_attention_heads"])}
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**fields))


@dataclass(frozen=True)
class TinyRecipe:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    seq_len: int
    batch_size: int
    max_steps: int  # the whole budget: a loaded machine makes the build slower, never different
    max_heldout_loss: float  # a target above this on the held-out corpus tail is refused, never published
    learning_rate: float
    seed: int
    family: str = "llama"


# ~1.3 M parameters; ~11 k tokens/s on 2 cores: 450 steps in ~2.5 min, training loss ~2.5. The bar is far below
# what a starved build reaches (47 steps: loss 6.2, every answer newlines; ln 2048 = 7.6).
TINY = TinyRecipe(name="tiny", vocab_size=2048, hidden_size=128, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, seq_len=128, batch_size=32,
                  max_steps=450, max_heldout_loss=4.5, learning_rate=3e-3, seed=0)
# For tests: the same family, ~15 s on one core, held-out loss ~2.9 (ln 512 = 6.2).
MICRO = TinyRecipe(name="micro", vocab_size=512, hidden_size=64, intermediate_size=256, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, seq_len=64, batch_size=16,
                   max_steps=400, max_heldout_loss=4.0, learning_rate=3e-3, seed=0)


def of_family(recipe: TinyRecipe, family: str) -> TinyRecipe:
    """The recipe with another family's architecture (same shape, corpus, tokenizer and training)."""
    if family not in FAMILY_ARCHITECTURES:
        raise Eagle3Error(f"no tiny target of family {family!r}: choose one of {', '.join(FAMILY_ARCHITECTURES)}")
    if family == recipe.family:
        return recipe
    return dataclasses.replace(recipe, name=f"{recipe.name}-{family.replace('_', '-')}", family=family)


def corpus_text() -> str:
    return "\n".join(topics[key] for key in sorted(topics))


def recipe_hash(recipe: TinyRecipe) -> str:
    """Hash of the build's inputs: the recipe, the corpus, and this file (which holds the training code).

    Training is bound by steps, so the same inputs give the same weights (the manifest lists their sha256).
    """
    digest = hashlib.sha256()
    digest.update(json.dumps(dataclasses.asdict(recipe), sort_keys=True).encode())
    digest.update(corpus_text().encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()


def train_tokenizer(text: str, vocab_size: int, chat: ChatMarkup = PROJECT_CHAT) -> PreTrainedTokenizerFast:
    """Byte-level BPE with `chat`'s special tokens and template: every string encodes, and BPE training has no
    randomness (same text, same merges)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(chat.special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([text], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=chat.bos, eos_token=chat.end,
                                   pad_token=chat.pad, chat_template=chat.template, model_max_length=MAX_POSITIONS)


def corpus_ids(tokenizer: PreTrainedTokenizerFast) -> torch.Tensor:
    # verbose=False: the whole corpus is longer than model_max_length on purpose (it is cut into windows)
    return torch.tensor(tokenizer(corpus_text(), add_special_tokens=False, verbose=False)["input_ids"])  # [tokens]


def tiny_model(recipe: TinyRecipe, tokenizer: PreTrainedTokenizerFast) -> PreTrainedModel:
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    model = family_model(recipe.family, vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size,
                         intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_hidden_layers,
                         num_attention_heads=recipe.num_attention_heads, num_key_value_heads=recipe.num_key_value_heads,
                         max_position_embeddings=MAX_POSITIONS, rope_theta=10000.0, tie_word_embeddings=False,
                         **special)
    model.generation_config = GenerationConfig(do_sample=False, **special)
    return model


def train(model: PreTrainedModel, ids: torch.Tensor, recipe: TinyRecipe, progress: Callable[[str], None]) -> dict:
    """AdamW on random corpus windows for exactly max_steps; warm-up, then cosine decay."""
    generator = torch.Generator().manual_seed(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)
    window = torch.arange(recipe.seq_len)  # [seq]
    model.train()
    losses: list[float] = []
    start, next_report = time.perf_counter(), 0.1
    for step in range(recipe.max_steps):
        done = step / recipe.max_steps  # fraction of the budget
        warmup = min(1.0, (len(losses) + 1) / WARMUP_STEPS)
        for group in optimizer.param_groups:
            group["lr"] = recipe.learning_rate * warmup * 0.5 * (1 + math.cos(math.pi * done))
        starts = torch.randint(0, len(ids) - recipe.seq_len, (recipe.batch_size, 1), generator=generator)
        batch = ids[starts + window]  # [batch, seq]
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if (step + 1) / recipe.max_steps >= next_report:
            elapsed = time.perf_counter() - start
            rate = len(losses) * recipe.batch_size * recipe.seq_len / elapsed
            progress(f"step {len(losses)}/{recipe.max_steps}  loss {loss.item():.3f}  {rate:,.0f} tokens/s  {elapsed:.0f} s")
            next_report = math.floor((step + 1) / recipe.max_steps * 10 + 1) / 10
    elapsed = time.perf_counter() - start
    model.eval()
    return {
        "final_loss": sum(losses[-LOSS_WINDOW:]) / len(losses[-LOSS_WINDOW:]),
        "steps": len(losses),
        "stopped_by": "step budget (max_steps)",
        "tokens_per_second": len(losses) * recipe.batch_size * recipe.seq_len / elapsed,
        "train_wall_seconds": elapsed,
    }


@torch.no_grad()
def heldout_loss(model: PreTrainedModel, ids: torch.Tensor, seq_len: int) -> float:
    """Mean next-token loss over the corpus tail that training never saw, in windows of seq_len."""
    windows = ids[-HELD_OUT_TOKENS:].view(-1, seq_len)  # [windows, seq]
    return model(input_ids=windows, labels=windows).loss.item()


def build_tiny_target(out_dir: Path, recipe: TinyRecipe = TINY, progress: Callable[[str], None] = print) -> Path:
    """Train and save the target (HF layout plus manifest.json), or reuse one built from the same inputs."""
    out_dir = Path(out_dir)
    content_hash = recipe_hash(recipe)
    if (out_dir / MANIFEST_FILE).exists() and read_manifest(out_dir).get("content_hash") == content_hash:
        progress(f"{out_dir}: reusing the cached {recipe.name} target ({content_hash[:12]})")
        return out_dir
    progress(f"building the {recipe.name} target into {out_dir} ({recipe.max_steps} training steps)")
    torch.manual_seed(recipe.seed)
    tokenizer = train_tokenizer(corpus_text(), recipe.vocab_size, FAMILY_CHAT[recipe.family])
    model = tiny_model(recipe, tokenizer)
    ids = corpus_ids(tokenizer)
    stats = train(model, ids[:-HELD_OUT_TOKENS], recipe, progress)
    stats["heldout_loss"] = heldout_loss(model, ids, recipe.seq_len)
    if stats["heldout_loss"] > recipe.max_heldout_loss:
        raise Eagle3Error(
            f"the {recipe.name} target's held-out loss is {stats['heldout_loss']:.3f} after {stats['steps']} steps "
            f"(training loss {stats['final_loss']:.3f}), above its bar {recipe.max_heldout_loss}: it would answer with "
            f"degenerate text; not published to {out_dir} (raise max_steps in the recipe)")
    with atomic_directory(out_dir, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp, kind="tiny-target",
                       fields={"recipe": dataclasses.asdict(recipe), "content_hash": content_hash, **stats})
    progress(f"{recipe.name} target: loss {stats['final_loss']:.3f}, held-out {stats['heldout_loss']:.3f} after {stats['steps']} steps "
             f"({stats['tokens_per_second']:,.0f} tokens/s, {stats['train_wall_seconds']:.0f} s)")
    return out_dir
