"""Probe: SGLang's MLA draft (Eagle3DeepseekV2ForCausalLM, models/kimi_k25_eagle3.py) loading our exports, and its
forward over one prefix, on the CPU.

job = {"drafts": {label: directory}, "inputs": {"aux": [T, n_aux * H], "ids": [T], "embed": [V, H]}}. Each draft
is loaded by loader.py's path (the release's own ServerArgs, ModelConfig, model loader and load_weights, with the
NaN sentinel), which reports what every tensor became. One substitution: on a CPU device SGLang builds an MLA
layer's rotary embedding with get_rope_cpu, which implements DeepSeek-YaRN scaling only (an AssertionError for a
draft without it); the release's get_rope, the one a GPU takes, is called instead.

The forward: the attention kernels of an MLA layer need a GPU, so the prefix's step is computed here in plain torch
from the parameters SGLang's loader made, in its absorbed form (q_nope times w_kc against the normalized latent, the
shared RoPE key beside it, the output through w_vc), with SGLang's own modules wherever they run on the CPU: the
RMSNorms' and rotary embedding's forward_native, the fused linear layers, the MLP's activation.

Answer: {"drafts": {label: {"load": loader.py's answer for it, "logits": [T, Dv], "carried": [T, H]}}}.
"""

from __future__ import annotations

import torch

import loader


def run(job: dict) -> dict:
    import sglang.srt.models.deepseek_v2 as deepseek_v2
    from sglang.srt.layers.rotary_embedding import get_rope

    def gpu_rope(*args, device=None, **kwargs):
        return get_rope(*args, **kwargs)

    deepseek_v2.get_rope_wrapper = gpu_rope
    inputs = {name: torch.tensor(value) for name, value in job["inputs"].items()}
    answers = {}
    for label, path in job["drafts"].items():
        load = loader.run({"drafts": {label: path}})["drafts"][label]
        answers[label] = {"load": load}
        if "error" not in load:
            with torch.no_grad():
                logits, carried = _forward(loader.LOADED, inputs["aux"].float(), inputs["ids"], inputs["embed"].float())
            answers[label].update(logits=logits.tolist(), carried=carried.tolist())
    return {"drafts": answers}


def _forward(model, aux: torch.Tensor, ids: torch.Tensor, embed: torch.Tensor):
    inner, length = model.model, ids.shape[0]
    positions = torch.arange(length)
    if inner.fc_norm is not None:
        chunks = aux.chunk(inner.num_aux_hidden_states, dim=-1)
        aux = torch.cat([norm.forward_native(chunk) for norm, chunk in zip(inner.fc_norm, chunks)], dim=-1)
    hidden = inner.fc(aux)[0]  # [T, H]
    layer = inner.midlayer
    x = torch.cat([layer.input_layernorm.forward_native(embed[ids]), layer.hidden_norm.forward_native(hidden)], -1)
    attended = _absorbed_attention(layer.self_attn, x, positions)
    h = hidden + attended
    mlp = layer.mlp
    h = h + mlp.down_proj(mlp.act_fn.forward_native(mlp.gate_up_proj(layer.post_attention_layernorm.forward_native(h))[0]))[0]
    normed = inner.norm.forward_native(h)
    carried = normed if inner.norm_output else h
    return normed @ model.lm_head.weight.T, carried


def _absorbed_attention(attn, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x [T, 2H] -> the attention output [T, H], causal over the prefix."""
    length, heads = x.shape[0], attn.num_local_heads
    q_latent, kv_latent, k_rope = attn.fused_qkv_a_proj_with_mqa(x)[0].split(
        [attn.q_lora_rank, attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    q = attn.q_b_proj(attn.q_a_layernorm.forward_native(q_latent))[0].view(length, heads, attn.qk_head_dim)
    q_nope, q_rope = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    latent = attn.kv_a_layernorm.forward_native(kv_latent)  # [T, kv_lora_rank], the cache's entry
    # the sentinel filled every floating buffer, the RoPE table (not a checkpoint tensor) among them: made anew
    attn.rotary_emb.cos_sin_cache = attn.rotary_emb._compute_cos_sin_cache().to(x.dtype)
    q_rope, k_rope = attn.rotary_emb.forward_native(positions, q_rope.reshape(length, -1).contiguous(),
                                                    k_rope.contiguous())
    q_rope, k_rope = q_rope.view(length, heads, -1), k_rope.view(length, -1)
    q_absorbed = torch.einsum("thn,hnc->thc", q_nope, attn.w_kc)  # [T, heads, kv_lora_rank]
    scores = (torch.einsum("thc,sc->hts", q_absorbed, latent)
              + torch.einsum("thr,sr->hts", q_rope, k_rope)) * attn.scaling  # [heads, T, T]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("hcv,thc->thv", attn.w_vc, torch.einsum("hts,sc->thc", weights, latent))  # [T, heads, v]
    return attn.o_proj(out.reshape(length, -1))[0]
