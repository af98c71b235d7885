"""Training throughput and memory.

1. The tiny config on this CPU: TTT training tokens/s and peak resident memory.
2. A Kimi-K2.5-sized draft (hidden 7168, 64 heads / 8 kv, intermediate 18432, draft vocab 32000,
   3 aux layers): one bf16 forward + backward of the TTT unroll at a short sequence, without optimizer
   state, plus an analytic memory estimate of a full AdamW step (which does not fit in 24 GiB here).
3. On a GPU, when present: the full step and model FLOPs utilisation.

    python benchmarks/train_throughput.py [--seq 64] [--steps 20]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from eagle3.formats.checkpoint import DraftConfig
from eagle3.model.draft import Eagle3Draft, init_weights
from eagle3.model.ttt import ttt_forward

KIMI = dict(hidden=7168, heads=64, kv_heads=8, intermediate=18432, draft_vocab=32000, vocab=163840, aux=3)


def draft(hidden, heads, kv_heads, intermediate, draft_vocab, vocab, aux, dtype) -> Eagle3Draft:
    config = DraftConfig(
        hidden_size=hidden, target_hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=hidden // heads, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=4096, vocab_size=vocab, draft_vocab_size=draft_vocab, torch_dtype="bfloat16",
        aux_layers=list(range(aux)), target_num_hidden_layers=aux + 2,
    )
    model = Eagle3Draft(config, torch.zeros(vocab, hidden, dtype=dtype))
    init_weights(model, 0)
    return model.to(dtype)


def trainable(model: Eagle3Draft) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def step_flops(params: int, tokens: int, steps: int) -> float:
    """6 N per token per TTT step (forward + backward), attention ignored at short sequences."""
    return 6.0 * params * tokens * steps


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def tiny(steps: int) -> None:
    model = draft(128, 4, 2, 512, 1024, 2048, 3, torch.float32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch, seq, ttt = 16, 256, 4
    aux, ids = torch.randn(batch, seq, 3 * 128), torch.randint(0, 2048, (batch, seq))
    for warm in range(2):
        sum(l.float().logsumexp(-1).mean() for l in ttt_forward(model, aux, ids, ttt)).backward()
    start = time.perf_counter()
    for _ in range(steps):
        loss = sum(l.float().logsumexp(-1).mean() for l in ttt_forward(model, aux, ids, ttt))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    seconds = time.perf_counter() - start
    print(f"tiny draft ({trainable(model) / 1e6:.2f} M trainable), batch {batch} x {seq}, TTT {ttt}: "
          f"{batch * seq * steps / seconds:,.0f} tokens/s, {seconds / steps * 1000:.0f} ms/step, peak RSS {peak_rss_gib():.2f} GiB")


def kimi_estimate(params: int, seq: int, ttt: int) -> None:
    gib = 2**30
    weights = params * 2  # bf16
    grads = params * 2
    adam = params * 4 * 3  # fp32 master copy + two moments
    activations_per_token = ttt * (2 * KIMI["hidden"] * 12 + KIMI["draft_vocab"] * 2 * 2)  # rough: layer + logits
    print(f"Kimi-sized draft: {params / 1e9:.2f} B trainable parameters (+ frozen {KIMI['vocab'] * KIMI['hidden'] / 1e9:.2f} B embedding)")
    print(f"  full AdamW step, analytic: weights {weights / gib:.1f} GiB + grads {grads / gib:.1f} GiB + "
          f"optimizer {adam / gib:.1f} GiB + embedding {KIMI['vocab'] * KIMI['hidden'] * 2 / gib:.1f} GiB "
          f"= {(weights + grads + adam + KIMI['vocab'] * KIMI['hidden'] * 2) / gib:.1f} GiB before activations "
          f"(~{activations_per_token * 2 / 2**20:.1f} MiB activations per token at TTT {ttt})")


def kimi(seq: int, ttt: int, device: str) -> None:
    dtype = torch.bfloat16
    model = draft(**KIMI, dtype=dtype).to(device)
    params = trainable(model)
    kimi_estimate(params, seq, ttt)
    aux = torch.randn(1, seq, KIMI["aux"] * KIMI["hidden"], dtype=dtype, device=device)
    ids = torch.randint(0, KIMI["vocab"], (1, seq), device=device)
    start = time.perf_counter()
    loss = sum(l.float().logsumexp(-1).mean() for l in ttt_forward(model, aux, ids, ttt))
    loss.backward()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    flops = step_flops(params, seq, ttt)
    print(f"  bf16 forward + backward, seq {seq}, TTT {ttt} on {device}: {seconds:.2f} s, {seq * ttt / seconds:,.0f} "
          f"token-steps/s, {flops / seconds / 1e9:,.1f} GFLOP/s, peak RSS {peak_rss_gib():.1f} GiB")
    if device == "cuda":
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        optimizer.step()
        torch.cuda.synchronize()
        print(f"  full step on GPU: peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; "
              f"MFU at 989 TFLOP/s bf16: {flops / seconds / 989e12:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    tiny(args.steps)
    kimi(args.seq, 3, "cuda" if torch.cuda.is_available() else "cpu")


if __name__ == "__main__":
    main()
