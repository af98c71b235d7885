"""Small EAGLE-3 drafts built inside the tests: random weights, a real vocab map, every layout."""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3.formats.checkpoint import DraftConfig, NativeDraft, expected_shapes, save_native_draft
from eagle3.formats.vocab_map import build_vocab_map

TARGET_LAYERS = 4
TARGET_VOCAB = 256
DRAFT_VOCAB = 64


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


def write_draft(path: Path, layout: str = "native", release: str | None = None, **overrides) -> Path:
    return save_native_draft(tiny_draft(**overrides), path, to=layout, release=release)
