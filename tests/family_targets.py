"""Tiny random targets of the families SGLang serves beside Llama, built with transformers' own classes (~1 s each):
five decoder layers, so three aux layers [1, 2, 3] stay below the last one on every family's rule."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

NUM_LAYERS = 5
AUX_LAYERS = [1, 2, 3]
VOCAB = 512
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=NUM_LAYERS,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
             tie_word_embeddings=False)
# family -> (config class, model class, what the family adds to SHAPE)
FAMILY_TARGETS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),  # per-head q/k norms
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                                                                 moe_intermediate_size=32, norm_topk_prob=True)),
    # Gemma 3: tied head, sandwich norms (post-attention and post-feed-forward), sliding-window layers
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                                                             tie_word_embeddings=True)),
}


def build_family_target(out: Path, family: str, seed: int = 0) -> Path:
    config_class, model_class, extra = FAMILY_TARGETS[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**SHAPE, **extra})
    model = getattr(transformers, model_class)(config).float()
    with torch.no_grad():  # norms away from 1, so a norm applied or skipped shows in the features
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.save_pretrained(out)
    return out
