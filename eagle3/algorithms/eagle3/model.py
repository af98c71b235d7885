"""The EAGLE-3 draft as SGLang serves it (llama_eagle3.py), in plain torch.

    hidden  = fc(cat(aux states))                           [B, T, H]   fused target features
              (EAGLE 3.1: `norm_before_fc` normalizes the concatenation, `fc_norm` each aux state, first)
    x       = cat(input_layernorm(embed(token)), hidden_norm(hidden))   [B, T, 2H]
    h       = hidden + o_proj(attention(x))                 residual from the hidden stream
    h       = h + mlp(post_attention_layernorm(h))          SwiGLU
    logits  = lm_head(norm(h))                              [B, T, draft_vocab]
h (before `norm`; after it with EAGLE 3.1's `norm_output`) is what the next drafting step feeds back as its hidden
stream.

Module names equal the canonical tensor names (`fc`, `midlayer.*`, `norm`, `lm_head`), so the state
dict is the native/sglang layout. `embed_tokens` is the target's, frozen, and never exported.
Attention takes its keys and values from a list of blocks with an explicit mask, which is how one
module serves training-time test (TTT), offline simulation and the reference server alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle3.algorithms.eagle3.checkpoint import DraftConfig
from eagle3.errors import Eagle3Error
from eagle3.model.blocks import MLP, BlockAttention, RMSNorm, TargetEmbeddingDraft, rotate

UNSUPPORTED_FLAGS = ("norm_before_residual",)  # speculators' option; no SGLang release serves it
TTT_QUERY_CHUNK = 512  # the most query rows per attention call in training-time test
TTT_MIN_CHUNK = 64


class TTTAttention(BlockAttention):
    """Attention over blocks, and training-time test's chunked form of it (both EAGLE-3 forms)."""

    def attend_ttt(self, q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
        """Training-time test, step k: q [B, heads, T, d]; keys/values k + 1 blocks [B, kv_heads, T, d].

        Block 0 (the prefix, built from target features) is seen causally; block j >= 1 (the chain's own
        step j) only at the query's own index. A dense mask over all blocks scores (k + 1) * T^2 entries.
        Here queries go in chunks (`ttt_chunk_rows`), each attending to the prefix up to its last row
        and to its own rows of the later blocks: about T^2 / 2 + k * chunk * T entries, the same softmax
        over the same keys, and the fused attention kernels keep no score matrix.
        """
        length, chunks = q.shape[2], []
        rows = ttt_chunk_rows(length)
        for start in range(0, length, rows):
            end = min(start + rows, length)
            chunk_keys = torch.cat([keys[0][:, :, :end]] + [k[:, :, start:end] for k in keys[1:]], dim=2)
            chunk_values = torch.cat([values[0][:, :, :end]] + [v[:, :, start:end] for v in values[1:]], dim=2)
            mask = ttt_chunk_mask(start, end, len(keys) - 1, q.device)
            chunks.append(self.attend(q[:, :, start:end], chunk_keys, chunk_values, mask))  # [B, rows, H]
        return torch.cat(chunks, dim=1)


class Attention(TTTAttention):
    """A Llama layer's attention: grouped heads of head_dim."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads, self.kv_heads, self.head_dim, self.theta = cfg.num_attention_heads, cfg.num_key_value_heads, d, cfg.rope_theta
        self.q_proj = nn.Linear(2 * h, self.heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.heads * d, h, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, 2H] -> rotated q [B, heads, T, d] and the new block's k, v [B, kv_heads, T, d]."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        return rotate(q, positions, self.theta), rotate(k, positions, self.theta), v


class MLAAttention(TTTAttention):
    """DeepSeek-V2 multi-latent attention over the draft's cat(embed, hidden) input, as SGLang's MLA draft
    (kimi_k25_eagle3.py) computes it, here in its decompressed form: every head's key is its own no-RoPE part (from
    the shared latent through kv_b_proj) beside one RoPE part all heads share, so the keys and values are plain
    multi-head ones and attend / attend_ttt serve both forms. SGLang's absorbed form computes the same scores."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        h, heads = cfg.hidden_size, cfg.num_attention_heads
        self.heads = self.kv_heads = heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.theta, self.interleaved = cfg.rope_theta, cfg.rope_interleave
        self.q_a_proj = nn.Linear(2 * h, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * h, cfg.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, h, bias=False)

    def project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, 2H] -> q, k [B, heads, T, nope + rope] and v [B, heads, T, nope + rope]: the value's v_dim
        columns, then zeros. The fused kernels (CPU's flash, CUDA's flash) take one head width; narrower values fall
        back to the math kernel, which materialises the scores (52 GiB of a Kimi-sized step). Padded once here, not
        per query chunk. The softmax scale is (nope + rope)^-0.5, SDPA's default for that width, as SGLang's without
        YaRN."""
        b, t, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, t, self.heads, -1).transpose(1, 2)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_a_layernorm.weight.numel(), self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, t, self.heads, -1).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, heads, T, nope], [B, heads, T, v_dim]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        k_rope = self.rotated(k_rope[:, None], positions).expand(b, self.heads, t, self.rope)  # one for all heads
        q = torch.cat([q_nope, self.rotated(q_rope, positions)], dim=-1)
        return q, torch.cat([k_nope, k_rope], dim=-1), F.pad(v, (0, self.nope + self.rope - self.v_dim))

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """As a Llama layer's, on values `project` zero-padded to the queries' width; the padding is dropped
        before o_proj."""
        return self.o_proj(self.attended_heads(q, keys, values, mask)[..., : self.v_dim].flatten(2))

    def rotated(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """RoPE on [B, heads, T, rope]. Interleaved pairs (2i, 2i + 1) are rotated as halves after gathering the
        even then the odd entries: q and k are permuted alike, so their dot products are the interleaved ones."""
        if self.interleaved:
            x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
        return rotate(x, positions, self.theta)


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg) if cfg.attention == "mla" else Attention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)


class Eagle3Draft(TargetEmbeddingDraft):
    def __init__(self, cfg: DraftConfig, embed_tokens: torch.Tensor):
        super().__init__()
        flags = [flag for flag in UNSUPPORTED_FLAGS if getattr(cfg, flag)]
        if flags or cfg.rope_scaling:
            raise Eagle3Error(f"the draft model does not implement {flags or ['rope_scaling']} (no SGLang release serves "
                              "norm_before_residual; rope scaling is not trained)")
        self.config = cfg
        self.embed_tokens = nn.Embedding.from_pretrained(embed_tokens, freeze=True)  # the target's, [V, H]
        num_aux, width = len(cfg.aux_layers), cfg.target_hidden_size
        self.input_norm = RMSNorm(num_aux * width, cfg.rms_norm_eps) if cfg.norm_before_fc else None
        self.fc_norm = nn.ModuleList(RMSNorm(width, cfg.rms_norm_eps) for _ in range(num_aux)) if cfg.fc_norm else None
        self.fc = nn.Linear(num_aux * width, cfg.hidden_size, bias=False)
        self.midlayer = DraftLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def hot_token_ids(self) -> torch.Tensor:
        """[draft_vocab] the target id each head row predicts, read the way SGLang reads d2t."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def fuse(self, aux: torch.Tensor) -> torch.Tensor:
        """aux [..., n_aux * TH] (the captured states, concatenated) -> the fused target features [..., H]."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:  # after input_norm when both are on, as SGLang orders them
            aux = torch.cat([norm(state) for norm, state in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1))], -1)
        return self.fc(aux)

    def project(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """One drafting step's new block: tokens [B, T], hidden [B, T, H] -> (q, k, v) for attention."""
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(self.embed_tokens(tokens)), layer.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        return layer.self_attn.project(x, positions)

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual from the hidden stream, then the MLP. Returns (the carried output [B, T, H], logits)."""
        h = self.output(hidden, attended)
        return h, self.logits(h)

    def output(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """What the next step carries [..., H]: the layer's output (residual from the hidden stream, then the MLP),
        before the final norm, or after it under norm_output."""
        layer = self.midlayer
        h = hidden + attended
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h) if self.config.norm_output else h

    def head_input(self, carried: torch.Tensor) -> torch.Tensor:
        """The carried output -> what lm_head reads: it after the final norm (applied once)."""
        return carried if self.config.norm_output else self.norm(carried)

    def logits(self, carried: torch.Tensor) -> torch.Tensor:
        """The carried output [..., H] -> draft-vocabulary logits [..., Dv]."""
        return self.lm_head(self.head_input(carried))


def ttt_chunk_rows(length: int) -> int:
    """Query rows per TTT attention call: an eighth of the sequence, from TTT_MIN_CHUNK to TTT_QUERY_CHUNK. A call
    scores its rows against each later block's rows where only the row's own index is visible, so smaller chunks waste
    less (but each call costs its own overhead: 128 rows at the least); the concatenated keys the calls keep for the
    backward stay ~4.5 x the sequence a step (at 4,096 tokens the chunk is 512, as the Kimi plan was sized)."""
    return min(TTT_QUERY_CHUNK, max(TTT_MIN_CHUNK, -(-length // 8)))


def ttt_chunk_mask(start: int, end: int, own_blocks: int, device=None) -> torch.Tensor:
    """[rows, end + own_blocks * rows] for query rows start..end-1: the prefix causally, then each later
    block's entry at the row's own index."""
    rows = end - start
    prefix = torch.ones(rows, end, dtype=torch.bool, device=device).tril(diagonal=start)
    own = torch.eye(rows, dtype=torch.bool, device=device)
    return torch.cat([prefix] + [own] * own_blocks, dim=1)


def freeze_head(model: Eagle3Draft, target_norm: torch.Tensor | None) -> None:
    """training.freeze_head: lm_head and the final norm stop training. `target_norm` [H], the target's final norm
    weight, becomes the draft's first (a draft trained from scratch, whose lm_head already holds the target's rows);
    None keeps what is there (an init_from draft's own). They stay in the state dict: SGLang loads both."""
    with torch.no_grad():
        if target_norm is not None:
            model.norm.weight.copy_(target_norm)
    model.norm.weight.requires_grad_(False)
    model.lm_head.weight.requires_grad_(False)
