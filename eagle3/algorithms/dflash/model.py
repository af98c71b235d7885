"""The DFlash (block-diffusion) draft as SGLang serves it (`srt/models/dflash.py`, `DFlashDraftModel`), in plain torch.

    context = hidden_norm(fc(cat(target layer states)))           [T, H]    once per position, every layer reads it
    block   = embed([x_P, mask, ..., mask])                        [Bk, H]   at positions P .. P + Bk - 1
    layer:    x = input_layernorm(h)
              keys/values = k_norm(k_proj(context)) ++ k_norm(k_proj(x)),  v_proj(context) ++ v_proj(x)
              h = h + o_proj(attention(q_norm(q_proj(x))))         the block sees the context before P and its whole
              h = h + mlp(post_attention_layernorm(h))             self (no causal mask inside a block)
    logits  = target lm_head(norm(h))                              position j of the block predicts x_{P+j}

The context's keys and values are made from the fused features alone (no input_layernorm), as SGLang's worker
writes them into each layer's cache (`kv_proj_only`, `apply_k_norm`, `apply_k_rope`). Embedding and head are the
target's, frozen, and never exported. Training runs many blocks of one sequence together: each anchor's block is a
run of queries in one flat sequence, masked to its own context and its own block (`block_mask`).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from eagle3.model.blocks import BlockAttention, MLP, RMSNorm, TargetEmbeddingDraft, attention_bias, matmul_dtype, rotate

DFLASH_FORMAT = "dflash-native"


class DFlashConfig(BaseModel):
    """The native config: everything needed to rebuild the draft and to serve it."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["dflash-native"] = DFLASH_FORMAT
    format_version: Literal[1] = 1
    hidden_size: int = Field(gt=0)
    target_hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    hidden_act: Literal["silu"] = "silu"
    vocab_size: int = Field(gt=0, description="the target's vocabulary")
    draft_vocab_size: int = Field(gt=0, description="the rows the training loss scores (the run's vocab map)")
    torch_dtype: Literal["bfloat16", "float16", "float32"]
    aux_layers: list[int] = Field(min_length=1, description="the target layers read (SGLang's target_layer_ids); "
                                  "our convention: id k = output of decoder layer k")
    target_num_hidden_layers: int = Field(gt=1)
    target_family: str | None = None
    block_size: int = Field(ge=2)
    mask_token_id: int = Field(ge=0)


class DFlashAttention(BlockAttention):
    """Qwen3's attention: grouped heads of head_dim, each query and key RMS-normed per head before RoPE."""

    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim, self.theta = cfg.num_attention_heads, cfg.num_key_value_heads, d, cfg.rope_theta
        self.q_proj = nn.Linear(h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def heads_of(self, x: torch.Tensor, count: int) -> torch.Tensor:
        """[B, T, count * d] -> [B, count, T, d]."""
        return x.view(*x.shape[:2], count, self.head_dim).transpose(1, 2)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> rotated keys and values [B, kv_heads, T, d]."""
        k = self.k_norm(self.heads_of(self.k_proj(x), self.kv_heads))
        return rotate(k, positions, self.theta), self.heads_of(self.v_proj(x), self.kv_heads)

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> rotated queries [B, heads, T, d]."""
        return rotate(self.q_norm(self.heads_of(self.q_proj(x), self.heads)), positions, self.theta)


class DFlashLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, context_kv: tuple[torch.Tensor, torch.Tensor],
                bias: torch.Tensor) -> torch.Tensor:
        """h [B, Q, H] the blocks' stream at `positions` [B, Q]; context_kv this layer's keys and values of the
        context [B, kv_heads, T, d]; bias [B, 1, Q, T + Q] additive."""
        attn = self.self_attn
        x = self.input_layernorm(h)
        keys, values = attn.keys_values(x, positions)
        keys, values = torch.cat([context_kv[0], keys], dim=2), torch.cat([context_kv[1], values], dim=2)
        h = h + attn.attend(attn.queries(x, positions), keys, values, bias)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(TargetEmbeddingDraft):  # export_state: SGLang's names, no embedding or head
    config_type = DFlashConfig
    served_name = "DFlashDraftModel"  # the class SGLang loads it as

    def __init__(self, cfg: DFlashConfig, embed_tokens: torch.Tensor, lm_head: torch.Tensor | None = None):
        """embed_tokens [V, H] and lm_head [V, H] the target's, frozen (lm_head defaults to an unset one of the same
        size: the memory plan's)."""
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens, freeze=True)
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        head = torch.empty_like(embed_tokens) if lm_head is None else lm_head
        self.register_buffer("lm_head", head, persistent=False)  # [V, H] SGLang drafts with the target's head
        # [Dv] the target ids the training loss scores (the run's draft vocabulary); not part of the served draft
        self.register_buffer("loss_ids", torch.arange(cfg.draft_vocab_size), persistent=False)

    def context(self, aux: torch.Tensor, start: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """aux [B, T, n * TH] the features of positions start..start+T-1 -> each layer's keys and values of the
        context there: position-wise, so made once for a sequence (or a piece at a time) and sliced for any prefix."""
        fused = self.hidden_norm(self.fc(aux))  # [B, T, H]
        positions = torch.arange(start, start + aux.shape[1], device=aux.device)
        return [layer.self_attn.keys_values(fused, positions) for layer in self.layers]

    def blocks(self, context: list[tuple[torch.Tensor, torch.Tensor]], first: torch.Tensor,
               anchors: torch.Tensor, size: int | None = None) -> torch.Tensor:
        """The blocks of `size` (None: the trained block_size; a server may draft smaller ones) anchored at `anchors`
        [B, N] (the position of each block's first token, `first` [B, N]) -> their stream after the final norm
        [B, N, size, H]. Block n sees the context before its anchor."""
        batch, count = anchors.shape
        size = size or self.config.block_size
        tokens = torch.full((batch, count, size), self.config.mask_token_id, device=anchors.device)
        tokens[:, :, 0] = first
        offsets = torch.arange(size, device=anchors.device)
        positions = (anchors[:, :, None] + offsets).flatten(1)  # [B, N * Bk]
        h = self.embed_tokens(tokens.flatten(1))  # [B, N * Bk, H]
        length = context[0][0].shape[2]
        bias = attention_bias(block_mask(anchors, size, length)[:, None], matmul_dtype(h))  # made once, every layer
        for layer, context_kv in zip(self.layers, context):
            h = layer(h, positions, context_kv, bias)
        return self.norm(h).view(batch, count, size, -1)

    def loss_head(self, dtype: torch.dtype) -> torch.Tensor:
        """[Dv, H] the target head's rows the loss scores, gathered once per forward: every prediction's logits use
        the one copy, which the backward keeps once (a copy per prediction was 15 x 0.46 GB at Kimi's size)."""
        return self.lm_head.index_select(0, self.loss_ids).to(dtype)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> the target id with the largest logit over the target's whole head, as SGLang drafts."""
        return (hidden @ self.lm_head.to(hidden.dtype).T).argmax(-1)


def block_mask(anchors: torch.Tensor, size: int, length: int) -> torch.Tensor:
    """[B, N * Bk, T + N * Bk] bool, True = visible, for the blocks anchored at `anchors` [B, N] over a context of
    `length` positions: a block's queries see the context before its anchor and every entry of their own block."""
    batch, count = anchors.shape
    context = torch.arange(length, device=anchors.device) < anchors[:, :, None]  # [B, N, T]
    block = torch.arange(count, device=anchors.device)
    own = block[:, None] == block[None, :]  # [N, N]
    own = own[:, None, :, None].expand(count, size, count, size).reshape(count * size, count * size)
    context = context[:, :, None, :].expand(batch, count, size, length).reshape(batch, count * size, length)
    return torch.cat([context, own.expand(batch, -1, -1)], dim=-1)
