"""Small EAGLE-3 drafts built inside the tests: random weights, a real vocab map, every layout."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from eagle3.algorithms.eagle3.checkpoint import DraftConfig, NativeDraft, expected_shapes, save_native_draft
from eagle3.draft.files import Verifier
from eagle3.draft.vocab_map import build_vocab_map

TARGET_LAYERS = 4
TARGET_VOCAB = 256
DRAFT_VOCAB = 64
# a tiny MLA draft's sizes (DraftConfig overrides): 4 heads of 8 + 4 query/key dims and 8 value dims
MLA = dict(attention="mla", q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
           num_key_value_heads=4, head_dim=12)


def tiny_config(**overrides) -> DraftConfig:
    fields = dict(
        hidden_size=32,
        target_hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        vocab_size=TARGET_VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        torch_dtype="bfloat16",
        aux_layers=[0, 1, 2],
        target_num_hidden_layers=TARGET_LAYERS,
        target_family="llama",
    )
    fields.update(overrides)
    return DraftConfig(**fields)


def tiny_draft(seed: int = 0, **overrides) -> NativeDraft:
    config = tiny_config(**overrides)
    generator = torch.Generator().manual_seed(seed)
    # A Zipf-like count vector: low ids frequent, with ties and unseen ids, like real token counts.
    counts = (1000 / torch.arange(1, config.vocab_size + 1)).to(torch.int64)
    counts[torch.randperm(config.vocab_size, generator=generator)[: config.vocab_size // 3]] = 0
    vocab_map, _ = build_vocab_map(counts, config.draft_vocab_size)
    dtype = getattr(torch, config.torch_dtype)
    tensors = {
        name: torch.randn(shape, generator=generator).to(dtype)
        for name, shape in expected_shapes(config).items()
        if name not in ("d2t", "t2d")
    }
    tensors.update(d2t=vocab_map.d2t, t2d=vocab_map.t2d)
    return NativeDraft(config=config, tensors=tensors)


def tiny_verifier(vocab: int = TARGET_VOCAB, hidden: int = 32, name: str = "tiny-target") -> Verifier:
    """The target a speculators export names, with a random embedding (no files: tests of the layout alone)."""
    embed = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(7))
    return Verifier(name, ["LlamaForCausalLM"], embed)


def write_draft(path: Path, layout: str = "native", release: str | None = None, **overrides) -> Path:
    draft = tiny_draft(**overrides)
    verifier = tiny_verifier(draft.config.vocab_size, draft.config.hidden_size) if layout == "speculators" else None
    return save_native_draft(draft, path, to=layout, release=release, verifier=verifier)


def write_tiny_target(path: Path, vocab: int = TARGET_VOCAB, hidden: int = 32, layers: int = TARGET_LAYERS,
                      prefix: str = "") -> Path:
    """A target directory as the speculators layout names it: a Llama config.json that transformers reads, and the
    target's head tensors (embedding, final norm, lm_head; random bf16) in model.safetensors under `prefix`."""
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": hidden // 4, "vocab_size": vocab, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 512, "torch_dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(11)
    head = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=generator),
            "lm_head.weight": torch.randn(vocab, hidden, generator=generator),
            "model.norm.weight": 1 + 0.1 * torch.randn(hidden, generator=generator)}
    save_file({prefix + name: t.to(torch.bfloat16) for name, t in head.items()}, path / "model.safetensors")
    return path
