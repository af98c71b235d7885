"""What every draft's config takes from a run's config the same way, whatever the algorithm."""

from __future__ import annotations

from eagle3.config.draft import DraftSection
from eagle3.config.run import TargetSection


def draft_sizes(draft: DraftSection, target: TargetSection, draft_vocab_size: int, aux_layers: list[int]) -> dict:
    """The draft config's fields read from the `draft` section around the target: its widths and vocabularies, norms,
    RoPE, dtype, and the target layers it reads (`aux_layers`: data.aux_layers; `draft_vocab_size`: vocab's)."""
    return dict(
        hidden_size=target.hidden_size,  # SGLang swaps in the target's embedding: sizes must match
        target_hidden_size=target.hidden_size,
        intermediate_size=draft.intermediate_size,
        num_attention_heads=draft.num_attention_heads,
        rms_norm_eps=draft.rms_norm_eps,
        rope_theta=draft.rope_theta,
        max_position_embeddings=draft.max_position_embeddings,
        vocab_size=target.vocab_size,
        draft_vocab_size=draft_vocab_size,
        torch_dtype=draft.torch_dtype,
        aux_layers=list(aux_layers),
        target_num_hidden_layers=target.num_hidden_layers,
        target_family=target.family,
    )
