"""Training throughput and memory.

1. The tiny config on this CPU: TTT training tokens/s and peak resident memory.
2. A Kimi-K2.5-sized draft (hidden 7168, 64 heads / 8 kv, intermediate 18432, draft vocab 32000,
   3 aux layers) through the trainer's step (teacher, TTT forward, loss, backward, AdamW, bf16 autocast),
   beside the step memory eagle3 plan measures for it on storage-less tensors. Here: a short sequence
   (the full step needs ~80 GiB). On a GPU: seq 4,096, TTT 7, 2 sequences (the Kimi config's share per
   GPU), with tokens/s, MFU and the measured peak against the plan's.

    python benchmarks/train_throughput.py [--seq N] [--ttt K] [--batch B] [--steps 20]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch

from eagle3.config.draft import DraftSection
from eagle3.config.node import NodeSection
from eagle3.algorithms.eagle3.checkpoint import DraftConfig
from eagle3.algorithms.eagle3.model import Eagle3Draft
from eagle3.model.blocks import init_weights
from eagle3.model.teacher import TeacherHead
from eagle3.model.blocks import LossRows
from eagle3.algorithms.eagle3.ttt import ttt_forward, ttt_loss
from eagle3.plan_time import draft_train_flops
from eagle3.algorithms.eagle3 import EAGLE3
from eagle3.train.memory import training_step_peak_bytes

KIMI = dict(hidden=7168, heads=64, kv_heads=8, intermediate=18432, draft_vocab=32000, vocab=163840, aux=3)


def draft_config(hidden, heads, kv_heads, intermediate, draft_vocab, vocab, aux) -> DraftConfig:
    return DraftConfig(
        hidden_size=hidden, target_hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=hidden // heads, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=4096, vocab_size=vocab, draft_vocab_size=draft_vocab, torch_dtype="bfloat16",
        aux_layers=list(range(aux)), target_num_hidden_layers=aux + 2,
    )


def draft(dtype, **shape) -> Eagle3Draft:
    model = Eagle3Draft(draft_config(**shape), torch.zeros(shape["vocab"], shape["hidden"], dtype=dtype))
    init_weights(model, 0)
    return model.to(dtype)


def trainable(model: Eagle3Draft) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def tiny(steps: int) -> None:
    model = draft(torch.float32, hidden=128, heads=4, kv_heads=2, intermediate=512, draft_vocab=1024, vocab=2048, aux=3)
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


def kimi_step(seq: int, ttt: int, batch: int, device: str, steps: int) -> None:
    """The trainer's step (teacher, TTT forward, loss, backward, AdamW) on a Kimi-shaped draft, next to
    the memory eagle3 plan measures for it on storage-less tensors."""
    config = draft_config(**KIMI)
    section = DraftSection(intermediate_size=config.intermediate_size, num_attention_heads=config.num_attention_heads,
                           num_key_value_heads=config.num_key_value_heads,
                           max_position_embeddings=config.max_position_embeddings)
    estimate = training_step_peak_bytes(EAGLE3, config, section, batch, seq, ttt, pre_norm=False, recompute=True)
    print(f"Kimi-sized draft, batch {batch} x {seq}, TTT {ttt}: eagle3 plan's measured step {estimate / 2**30:.1f} GiB "
          "(activations, teacher, gradients; weights and optimizer apart)")
    dev = torch.device(device)
    with torch.device(dev):
        model = Eagle3Draft(config, torch.zeros(KIMI["vocab"], KIMI["hidden"]))
    params = trainable(model)
    teacher = TeacherHead(torch.randn(KIMI["vocab"], KIMI["hidden"], dtype=torch.bfloat16, device=dev) * 0.02,
                          torch.arange(KIMI["draft_vocab"], device=dev))
    # AdamW's 7.7 GB of moments only on a GPU: with them the step does not fit this 24 GiB machine.
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4) if dev.type == "cuda" else None
    aux = torch.randn(batch, seq, KIMI["aux"] * KIMI["hidden"], device=dev)
    last = torch.randn(batch, seq, KIMI["hidden"], device=dev)
    ids = torch.randint(0, KIMI["vocab"], (batch, seq), device=dev)
    rows = LossRows.of(torch.ones(batch, seq, dtype=torch.long), ttt).to(dev)  # every token generated
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16)

    def step() -> None:
        taught = teacher(last, rows.teacher)
        with autocast:
            stats = ttt_loss(model, aux, ids, taught, rows)
        stats.loss_sum.sum().backward()
        if optimizer is not None:
            optimizer.step()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: kernels chosen, AdamW state made
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    if dev.type == "cuda":
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    flops = draft_train_flops(params, ttt, batch * seq) + teacher_flops(batch * seq)
    print(f"  {device}: {seconds:.2f} s/step, {batch * seq / seconds:,.0f} tokens/s, {flops / seconds / 1e12:.1f} TFLOP/s "
          f"({params / 1e9:.2f} B trainable), peak RSS {peak_rss_gib():.1f} GiB")
    if dev.type == "cuda":
        step_peak = (torch.cuda.max_memory_allocated() - before) / 2**30
        print(f"  GPU: step peak {step_peak:.1f} GiB above the weights and optimizer (plan: {estimate / 2**30:.1f} GiB), "
              f"total peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB; MFU at 989 TFLOP/s bf16: "
              f"{flops / seconds / 989e12:.1%}")
        # what eagle3 plan assumes as node.mfu.train, measured: its FLOPs (no teacher) over the step's time
        peak = NodeSection().peak_tflops
        measured = draft_train_flops(params, ttt, batch * seq) / seconds / (peak * 1e12)
        print(f"  measured MFU of the draft training step {measured:.3f} (6 x trainable x TTT per token at "
              f"node.peak_tflops {peak:g}): set node.mfu.train to it (assumed {NodeSection().mfu.train:g})")


def teacher_flops(tokens: int) -> float:
    """Full-vocabulary argmax plus the draft rows' logits."""
    return 2.0 * tokens * KIMI["hidden"] * (KIMI["vocab"] + KIMI["draft_vocab"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=None, help="Kimi step tokens per sequence (default 4096 on a GPU, 64 here)")
    parser.add_argument("--ttt", type=int, default=None, help="TTT steps (default 7 on a GPU, 2 here)")
    parser.add_argument("--batch", type=int, default=None, help="sequences per step (default 2 on a GPU, 1 here)")
    parser.add_argument("--steps", type=int, default=20, help="timed tiny steps")
    args = parser.parse_args()
    tiny(args.steps)
    gpu = torch.cuda.is_available()
    kimi_step(args.seq or (4096 if gpu else 64), args.ttt or (7 if gpu else 2), args.batch or (2 if gpu else 1),
              "cuda" if gpu else "cpu", steps=5 if gpu else 1)


if __name__ == "__main__":
    main()
