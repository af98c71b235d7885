"""The DSpark draft as SGLang serves it (`srt/models/dspark.py`, `DSparkDraftModel` over `DFlashDraftModel`): DFlash's
parallel backbone, then a light sequential head that samples the block left to right.

    hidden  = the DFlash backbone's stream of the block [x_P, mask, ..., mask]    [gamma, H]  at P .. P + gamma - 1
    base_k  = target lm_head(hidden_k)                                            [V]   entry k predicts x_{P+1+k}
    x_k     = argmax(base_k + markov_w2(latent(prev_k, hidden_k)))               prev_0 = x_P, prev_k = x_{k-1}
    conf_k  = sigmoid(proj([hidden_k; markov_w1[prev_k]]))                        the chance x_k survives verification

Every entry predicts, the anchor's too (SGLang's `sample_from_anchor`, the only form before 0.5.20): a block of gamma
entries drafts gamma tokens, verified in a window of gamma + 1. The Markov latent is markov_w1[prev] (vanilla), gated
by the hidden state (gated), or a recurrent state over the block (rnn); the bias is markov_w2 of it over the whole
vocabulary. Training feeds the true previous tokens (teacher forcing) and scores the biased logits
(`eagle3.algorithms.dspark.spark`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import nn

from eagle3.algorithms.dflash.model import DFlashConfig, DFlashDraft

DSPARK_FORMAT = "dspark-native"
MarkovHeadType = Literal["vanilla", "gated", "rnn"]


class DSparkConfig(DFlashConfig):
    """DFlash's fields; block_size is gamma here (the entries of a block, each drafting one token)."""

    format: Literal["dspark-native"] = DSPARK_FORMAT
    block_size: int = Field(ge=1, description="gamma: the block's entries, each drafting a token")
    markov_rank: int = Field(gt=0)
    markov_head_type: MarkovHeadType = "vanilla"
    confidence_head: bool = True
    confidence_head_with_markov: bool = True
    # the objective's weights (docs/training.md, "DSpark"): soft cross-entropy, sum |p - q| against the teacher, and
    # the confidence head's BCE against 1 - |p - q| / 2
    ce_weight: float = Field(ge=0)
    l1_weight: float = Field(ge=0)
    confidence_weight: float = Field(ge=0)


class MarkovHead(nn.Module):
    """The previous token's low-rank bias on a step's logits: markov_w2 · latent, latent from markov_w1[prev]."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        rank, hidden = cfg.markov_rank, cfg.hidden_size
        self.kind = cfg.markov_head_type
        self.markov_w1 = nn.Embedding(cfg.vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, cfg.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(hidden + rank, rank)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * rank + hidden, 3 * rank)

    def step(self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None):
        """prev [...] previous tokens, hidden [..., H] this entry's stream, state [..., r] (rnn; None at a block's
        first entry) -> (latent [..., r], the next entry's state)."""
        embedded = self.markov_w1(prev)
        if self.kind == "vanilla":
            return embedded, state
        if self.kind == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded.to(hidden.dtype)], -1))) * embedded, state
        state = torch.zeros_like(embedded) if state is None else state
        joint = self.joint_proj(torch.cat([state, embedded, hidden.to(embedded.dtype)], -1))  # [..., 3r]
        gate, candidate, output = joint.chunk(3, -1)
        gate = torch.sigmoid(gate)
        return torch.tanh(output), gate * state + (1 - gate) * torch.tanh(candidate)

    def latents(self, prev: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """prev [..., K] each entry's previous token along blocks of K, hidden [..., K, H] -> latents [..., K, r]."""
        if self.kind != "rnn":
            return self.step(prev, hidden, None)[0]
        out, state = [], None
        for k in range(prev.shape[-1]):
            latent, state = self.step(prev[..., k], hidden[..., k, :], state)
            out.append(latent)
        return torch.stack(out, -2)


class ConfidenceHead(nn.Module):
    """A logit per entry for the chance its token is accepted: proj of the stream (and the previous token's
    markov_w1 row, with_markov)."""

    def __init__(self, cfg: DSparkConfig):
        super().__init__()
        self.with_markov = cfg.confidence_head_with_markov
        self.proj = nn.Linear(cfg.hidden_size + (cfg.markov_rank if self.with_markov else 0), 1)

    def forward(self, hidden: torch.Tensor, prev_embedded: torch.Tensor) -> torch.Tensor:
        """hidden [..., H], prev_embedded [..., r] -> logits [...]."""
        features = torch.cat([hidden, prev_embedded.to(hidden.dtype)], -1) if self.with_markov else hidden
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1)


class DSparkDraft(DFlashDraft):  # export_state: SGLang's names (markov_head.*, confidence_head.proj.*)
    config_type = DSparkConfig
    served_name = "Qwen3DSparkModel"

    def __init__(self, cfg: DSparkConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None = None):
        super().__init__(cfg, embed_tokens, lm_head)
        self.markov_head = MarkovHead(cfg)
        self.confidence_head = ConfidenceHead(cfg) if cfg.confidence_head else None

    def reset_heads(self) -> None:
        """After init_weights: no Markov bias and an even confidence at the start, so a fresh draft drafts as its
        backbone does and the heads learn from there."""
        with torch.no_grad():
            self.markov_head.markov_w2.weight.zero_()
            if self.confidence_head is not None:
                self.confidence_head.proj.bias.zero_()

    def draft_block(self, hidden: torch.Tensor, anchor: int) -> list[int]:
        """hidden [gamma, H] a block's stream after x_P = `anchor` -> its gamma greedy tokens, left to right, each
        biased by the one before over the target's whole head (SGLang's draft_markov_block)."""
        base = hidden @ self.lm_head.to(hidden.dtype).T  # [gamma, V]
        prev, state, tokens = torch.tensor([anchor], device=hidden.device), None, []
        for k in range(hidden.shape[0]):
            latent, state = self.markov_head.step(prev, hidden[k : k + 1], state)
            prev = (base[k : k + 1] + self.markov_head.markov_w2(latent).to(base.dtype)).argmax(-1)
            tokens.append(int(prev))
        return tokens
