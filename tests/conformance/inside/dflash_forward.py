"""Probe: SGLang's DFlashDraftModel (models/dflash.py) loading our export, and one block's forward, on the CPU.

job = {"drafts": {label: directory}, "inputs": {"aux": [T, n * H], "ids": [T], "embed": [V, H]}, "anchor": P,
"block_size": Bk, "mask_token_id": id}. Each draft is loaded by loader.py's path (the release's own ServerArgs,
ModelConfig, loader and load_weights, with its NaN sentinel).

The forward: the layers' RadixAttention needs an attention backend and a KV pool, so the block's step is computed
here from the modules SGLang's loader built, wherever they run on the CPU: the context as the worker makes it
(`project_target_hidden`, then each layer's `kv_proj_only` with k_norm and RoPE, as `apply_k_norm` and `apply_k_rope`
do), the block's fused qkv_proj, q/k norms, rotary embedding (forward_native), o_proj, the norms' forward_native, the
MLP's fused gate_up_proj and activation. Only the attention itself is plain torch: the block's queries over the
context before P and the whole block, at SGLang's scaling.

Answer: {"drafts": {label: {"load": loader.py's answer, "hidden": [Bk, H] the block after the final norm}}}.
"""

from __future__ import annotations

import torch

import loader


def run(job: dict) -> dict:
    inputs = {name: torch.tensor(value) for name, value in job["inputs"].items()}
    answers = {}
    for label, path in job["drafts"].items():
        load = loader.run({"drafts": {label: path}, "algorithm": "EAGLE3"})["drafts"][label]
        answers[label] = {"load": load}
        if "error" not in load:
            with torch.no_grad():
                hidden = _block(loader.LOADED, inputs["aux"].float(), inputs["ids"], inputs["embed"].float(),
                                job["anchor"], job["block_size"], job["mask_token_id"])
            answers[label]["hidden"] = hidden.tolist()
    return {"drafts": answers}


def _block(model, aux, ids, embed, anchor: int, size: int, mask: int) -> torch.Tensor:
    context = model.project_target_hidden(aux[:anchor])  # [P, H]: fc, then hidden_norm
    context_positions = torch.arange(anchor)
    block_ids = torch.full((size,), mask)
    block_ids[0] = ids[anchor]
    positions = torch.arange(anchor, anchor + size)
    h = embed[block_ids]  # [Bk, H] the target's embedding
    for layer in model.layers:
        attn = layer.self_attn
        # the sentinel filled every floating buffer, the RoPE table (not a checkpoint tensor) among them: made anew
        attn.rotary_emb.cos_sin_cache = attn.rotary_emb._compute_cos_sin_cache().to(h.dtype)
        context_k, context_v = attn.kv_proj_only(context)
        context_k = _rope(attn, context_positions, _per_head(attn.k_norm, context_k, attn.head_dim))
        x = layer.input_layernorm.forward_native(h)
        q, k, v = attn.qkv_proj(x)[0].split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = _per_head(attn.q_norm, q, attn.head_dim)
        k = _per_head(attn.k_norm, k, attn.head_dim)
        q, k = attn.rotary_emb.forward_native(positions, q.contiguous(), k.contiguous())
        keys, values = torch.cat([context_k, k]), torch.cat([context_v, v])
        h = h + attn.o_proj(_attention(q, keys, values, attn))[0]
        mlp = layer.mlp
        h = h + mlp.down_proj(mlp.act_fn.forward_native(
            mlp.gate_up_proj(layer.post_attention_layernorm.forward_native(h))[0]))[0]
    return model.norm.forward_native(h)


def _per_head(norm, x: torch.Tensor, head_dim: int) -> torch.Tensor:
    return norm.forward_native(x.reshape(-1, head_dim)).view_as(x)


def _rope(attn, positions: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return attn.rotary_emb.forward_native(positions, torch.zeros_like(k), k.contiguous())[1]


def _attention(q, keys, values, attn) -> torch.Tensor:
    """q [Bk, heads * d]; keys, values [P + Bk, kv_heads * d] -> [Bk, heads * d], every key visible (the context is
    the prefix before the anchor, the block sees all of itself)."""
    d, heads, kv_heads = attn.head_dim, attn.num_heads, attn.num_kv_heads
    q = q.view(-1, heads, d).transpose(0, 1)  # [heads, Bk, d]
    group = heads // kv_heads
    keys = keys.view(-1, kv_heads, d).transpose(0, 1).repeat_interleave(group, 0)
    values = values.view(-1, kv_heads, d).transpose(0, 1).repeat_interleave(group, 0)
    weights = (q @ keys.transpose(1, 2) * attn.scaling).softmax(-1)
    return (weights @ values).transpose(0, 1).reshape(q.shape[1], -1)
