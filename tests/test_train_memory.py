"""The lean training step (issue 28) against the step it replaced, written out here with the old math: kv heads repeated
per query head under a dense TTT mask, float32 norms and SwiGLU kept for autograd, a log-softmax loss over every step's
logits after the whole forward. Same loss and gradients; less memory."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from eagle3.algorithms.eagle3 import model as draft_module
from eagle3.algorithms.eagle3.model import Eagle3Draft
from eagle3.model.blocks import causal_mask
from eagle3.model.teacher import TeacherHead
from eagle3.model.blocks import LossRows
from eagle3.algorithms.eagle3.ttt import TTTModel, shift_left
from eagle3.train.memory import AllocationPeak
from helpers import tiny_draft

STEPS = 3


def old_norm(norm, x):
    x32 = x.float()
    return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)).to(x.dtype)


def old_attend(attention, q, keys, values, mask):
    group = attention.heads // attention.kv_heads
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    b, _, t, _ = out.shape
    return attention.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def old_step(model: Eagle3Draft, aux, ids, teacher, loss_mask):
    """Every step's logits first, then the loss over them (the previous ttt_forward, attend and step_stats)."""
    layer, attention = model.midlayer, model.midlayer.self_attn
    length = ids.shape[1]
    index = torch.arange(length)
    hidden, keys, values, step_logits = model.fc(aux), [], [], []
    for k in range(STEPS):
        x = torch.cat([old_norm(layer.input_layernorm, model.embed_tokens(shift_left(ids, 1 + k))),
                       old_norm(layer.hidden_norm, hidden)], dim=-1)
        q, new_k, new_v = attention.project(x, index + k)
        keys.append(new_k)
        values.append(new_v)
        mask = torch.cat([causal_mask(length)] + [torch.eye(length, dtype=torch.bool)] * k, dim=1)
        h = hidden + old_attend(attention, q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)
        mlp = layer.mlp
        normed = old_norm(layer.post_attention_layernorm, h)
        hidden = h + mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed))
        step_logits.append(model.lm_head(old_norm(model.norm, hidden)))
    losses = []
    for k, logits in enumerate(step_logits):
        n = length - 2 - k
        valid = loss_mask[:, 2 + k :].bool() & teacher.in_draft[:, 1 + k : 1 + k + n]
        z = logits[:, :n].float()
        losses.append(((-(teacher.probs[:, 1 + k : 1 + k + n] * z.log_softmax(-1)).sum(-1)) * valid).sum())
    return torch.stack(losses)


def inputs(model, length, generator):
    head = TeacherHead(torch.randn(40, 32, generator=generator), model.hot_token_ids())
    aux, last = torch.randn(2, length, 96, generator=generator), torch.randn(2, length, 32, generator=generator)
    ids = torch.randint(0, 40, (2, length), generator=generator)
    loss_mask = (torch.rand(2, length, generator=generator) > 0.2).long()
    return aux, ids, head, last, loss_mask


@pytest.mark.parametrize("bf16", [False, True])  # the CPU's float32 step, and autocast's bf16 (the GPU's policy)
def test_the_lean_step_gives_the_old_loss_and_gradients(bf16, monkeypatch):
    monkeypatch.setattr(draft_module, "TTT_QUERY_CHUNK", 5)  # several query chunks, the last one short
    model = tiny_draft(vocab=40, draft_vocab=16)  # 4 query heads over 2 kv heads
    assert model.midlayer.self_attn.kv_heads < model.midlayer.self_attn.heads
    aux, ids, head, last, loss_mask = inputs(model, 13, torch.Generator().manual_seed(0))
    params = [p for p in model.parameters() if p.requires_grad]
    results = []
    rows = LossRows.of(loss_mask, STEPS)
    for step in (lambda: TTTModel(model)(aux, ids, head(last, rows.teacher), rows)[0],
                 lambda: old_step(model, aux, ids, head(last), loss_mask)):
        with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            losses = step()
        results.append((losses, torch.autograd.grad(losses.sum(), params)))
    (new_loss, new_grads), (old_loss, old_grads) = results
    tolerance = {"rtol": 2e-2, "atol": 2e-2} if bf16 else {"rtol": 1e-5, "atol": 1e-6}
    torch.testing.assert_close(new_loss, old_loss, **tolerance)
    for (name, _), new, old in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], new_grads, old_grads):
        scale = old.abs().max().clamp_min(1e-6)  # bf16 gradients: compared relative to the tensor's largest entry
        torch.testing.assert_close(new / scale, old / scale, **tolerance, msg=lambda m: f"{name}: {m}")


def test_the_lean_step_allocates_well_under_two_thirds_of_the_old_one():
    """Measured as the dry run measures (storage-less tensors under bf16 autocast), at a shape where the saved
    activations dominate: the old step's repeated kv heads, float32 logits and norm intermediates are gone."""
    config = tiny_draft(vocab=40, draft_vocab=16).config.model_copy(update={
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 4, "draft_vocab_size": 512, "vocab_size": 1024,
        "intermediate_size": 96})
    peaks = []
    rows = LossRows.of(torch.ones(1, 256, dtype=torch.long), STEPS)  # on the host, as the trainer makes them
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = Eagle3Draft(config, torch.empty(1024, 32))
        aux, last = torch.empty(1, 256, 96), torch.empty(1, 256, 32)
        ids, loss_mask = torch.zeros(1, 256, dtype=torch.long), torch.ones(1, 256, dtype=torch.long)
        head = TeacherHead(torch.empty(1024, 32, dtype=torch.bfloat16), torch.arange(512))
        compact, dense = head(last, rows.teacher), head(last)
        for step in (lambda: TTTModel(model)(aux, ids, compact, rows)[0],
                     lambda: old_step(model, aux, ids, dense, loss_mask)):
            with AllocationPeak() as tracker:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    losses = step()
                losses.sum().backward()
            peaks.append(tracker.peak)
            model.zero_grad(set_to_none=True)
    new, old = peaks
    assert new < 0.65 * old, f"the lean step peaks at {new:,} bytes, the old one at {old:,}"
