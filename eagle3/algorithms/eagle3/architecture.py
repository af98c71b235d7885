"""The EAGLE-3 draft a run trains: its architecture from the pipeline config."""

from __future__ import annotations

from eagle3.algorithms.sizes import draft_sizes
from eagle3.algorithms.eagle3.checkpoint import DraftConfig
from eagle3.config.draft import MLA_SIZES, DraftSection
from eagle3.config.run import TargetSection


def trained_draft_config(draft: DraftSection, target: TargetSection, draft_vocab_size: int,
                         aux_layers: list[int]) -> DraftConfig:
    """The architecture a run trains: the `draft` section's sizes around the target's width and vocabulary."""
    return DraftConfig(
        **draft_sizes(draft, target, draft_vocab_size, aux_layers),
        num_key_value_heads=draft.num_key_value_heads or draft.num_attention_heads,  # mla: every head its own key
        head_dim=(draft.qk_nope_head_dim + draft.qk_rope_head_dim if draft.attention == "mla"
                  else target.hidden_size // draft.num_attention_heads),
        fc_norm=draft.fc_norm,
        norm_before_fc=draft.norm_before_fc,
        norm_output=draft.norm_output,
        attention=draft.attention,
        **{name: getattr(draft, name) for name in MLA_SIZES},
    )
