"""Which of a transformers target's hidden states an aux layer id names (docs/contracts.md, "Aux hidden-state layer ids").

Inside the project aux id k means "the output of decoder layer k". A transformers forward with
`output_hidden_states=True` returns the embeddings' output first, then each decoder layer's output, so id k
is `hidden_states[k + 1]`; a forward hook on `model.model.layers[k]` records the same tensor. What an SGLang
release captures for an id is another matter, kept per model file and release in `eagle3.contract.engines`.
"""

from __future__ import annotations

from typing import Sequence

import torch


def hidden_state_index(layer: int) -> int:
    """The index of aux layer `layer` in transformers' `hidden_states`: [0] is the embeddings' output, so the
    output of decoder layer k comes one later."""
    return layer + 1


def aux_states(hidden_states: Sequence[torch.Tensor], layers: Sequence[int]) -> torch.Tensor:
    """hidden_states: a forward's `hidden_states`, each [B, T, H] -> [B, T, len(layers) * H], the aux layers'
    outputs concatenated in the order given (the order the draft's fc reads them)."""
    return torch.cat([hidden_states[hidden_state_index(k)] for k in layers], dim=-1)
