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

DSpark drafts (Qwen3DSparkModel, DSparkDraftModel over DFlashDraftModel): with "lm_head" [V, H] among the inputs (the
target's head), the block's stream then goes through the release's own heads as its DSPARK worker drives them, greedy:
the head is attached as the worker attaches the target's (a ParallelLMHead, `attach_shared_modules`), then
`compute_base_logits`, the Markov block of `dspark_draft.sample_draft_block` (prev_0 = the anchor, its step logits
kept), and the confidence where the head is built (the model's `compute_confidence` from 0.5.23, the planner's
`compute_confidence` before). 0.5.23 drafts once more with `greedy_draft` (its fused greedy step, no logits kept).
"environment" ({label: {variable: value}}) is loader.py's.

Answer: {"drafts": {label: {"load": loader.py's answer, "hidden": [Bk, H] the block after the final norm; DSpark:
"base" [gamma, V], "step_logits" [gamma, V] base + Markov bias, "drafted" [gamma], "drafted_greedy" [gamma] (0.5.23),
"confidence" [gamma] or None, "gamma" the model's}}}.
"""

from __future__ import annotations

import inspect
import types

import torch

import loader


def run(job: dict) -> dict:
    inputs = {name: torch.tensor(value) for name, value in job["inputs"].items()}
    answers = {}
    for label, path in job["drafts"].items():
        load = loader.run({"drafts": {label: path}, "algorithm": "EAGLE3",
                           "environment": job.get("environment")})["drafts"][label]
        answers[label] = {"load": load}
        if "error" not in load:
            with torch.no_grad():
                hidden = _block(loader.LOADED, inputs["aux"].float(), inputs["ids"], inputs["embed"].float(),
                                job["anchor"], job["block_size"], job["mask_token_id"])
                answers[label]["hidden"] = hidden.tolist()
                if "lm_head" in inputs:
                    answers[label].update(_dspark(loader.LOADED, hidden, int(inputs["ids"][job["anchor"]]),
                                                  inputs["lm_head"].float()))
    return {"drafts": answers}


def _dspark(model, hidden: torch.Tensor, anchor: int, lm_head: torch.Tensor) -> dict:
    """The DSpark heads on the block's stream `hidden` [gamma, H] after x_P = `anchor`, as the worker's eager greedy
    proposal runs them (batch of one)."""
    from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
    from sglang.srt.speculative.dspark_components import dspark_draft, dspark_planner

    head = ParallelLMHead(*lm_head.shape, params_dtype=lm_head.dtype)  # the target's, padded as the target's is
    head.weight_loader(head.weight, lm_head)
    model.attach_shared_modules(embed_tokens=None, lm_head=head)
    gamma = hidden.shape[0]
    base, features = model.compute_base_logits(hidden)
    anchors = torch.tensor([anchor])
    # no sampling info: every row greedy; greedy_draft False (0.5.23): the step logits are kept
    common = dict(base_logits=base.view(1, gamma, -1), anchor_tokens=anchors, draft_hidden=hidden.view(1, gamma, -1),
                  sampling_info=None, markov_head=model.markov_head, device=torch.device("cpu"), greedy_draft=False)
    if "tp_sync" in inspect.signature(dspark_draft.sample_draft_block).parameters:  # 0.5.20 on: one rank, no sync
        common["tp_sync"] = dspark_draft.SpecTpSync(types.SimpleNamespace(world_size=1, rank_in_group=0))
    if hasattr(dspark_draft, "DraftNoise"):  # 0.5.23: the draft's Philox noise (unused by argmax rows)
        common["noise"] = dspark_draft.DraftNoise(key=0, offset=torch.zeros(1, dtype=torch.int64))
    block = _call(dspark_draft.sample_draft_block, **common)
    answer = {"base": base.tolist(), "step_logits": block.corrected_logits[0].tolist(),
              "drafted": block.draft_tokens[0].tolist(), "gamma": model.gamma, "confidence": None}
    if "greedy_draft" in inspect.signature(dspark_draft.sample_draft_block).parameters:
        answer["drafted_greedy"] = _call(dspark_draft.sample_draft_block, **{**common, "greedy_draft": True}
                                         ).draft_tokens[0].tolist()
    if model.confidence_head is not None:
        # a buffer no checkpoint holds: the sentinel filled it, the model builds it as 1 (no STS calibration)
        model.confidence_head.sts_temperatures.fill_(1.0)
        if hasattr(model, "compute_confidence"):  # 0.5.23
            confidence = model.compute_confidence(anchor_tokens=anchors, draft_tokens=block.draft_tokens,
                                                  confidence_features=features)[0]
        else:
            confidence = dspark_planner.compute_confidence(
                draft_hidden=hidden.view(1, gamma, -1), anchor_tokens=anchors, draft_tokens=block.draft_tokens,
                confidence_head=model.confidence_head, markov_head=model.markov_head, gamma=gamma)
        answer["confidence"] = confidence[0].tolist()
    return answer


def _call(fn, **kwargs):
    """`fn` with those keyword arguments its signature in this release takes."""
    accepted = inspect.signature(fn).parameters
    return fn(**{key: value for key, value in kwargs.items() if key in accepted})


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
