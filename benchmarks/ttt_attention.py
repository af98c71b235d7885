"""TTT attention and the teacher: the dense forms they replaced against the compact ones.

1. Attention over all K training-time-test steps at T tokens: the dense form (one [T, (k+1) T] mask per
   step) against query chunks (the causal prefix plus each step's own diagonal). Forward + backward
   time and peak memory of the real tensors, and the entries each form scores.
2. The teacher at Kimi-K2.5's vocabulary (V 163,840, draft vocabulary 32,000, hidden 7,168): full
   [T, V] logits then argmax and softmax over the draft ids, against the chunked argmax and draft-row
   softmax. Time, peak memory, ratio, and the size the full form would have at 8 x 4,096 tokens in bf16.

On this CPU the attention runs with a few heads (the dense form at 64 heads does not fit 24 GiB);
the entry counts are per head and hold for any head count.

    OMP_NUM_THREADS=1 python benchmarks/ttt_attention.py [--seq 4096] [--steps 7] [--heads 4] [--tokens 1024]
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3.algorithms.eagle3.model import Attention, ttt_chunk_rows
from eagle3.model.blocks import causal_mask
from eagle3.model.teacher import TeacherHead
from eagle3.train.memory import AllocationPeak

KIMI_VOCAB, KIMI_DRAFT_VOCAB, KIMI_HIDDEN, HEAD_DIM = 163840, 32000, 7168, 112


class Tiny:
    """Just what Attention reads from a draft config."""

    def __init__(self, heads: int):
        self.hidden_size, self.head_dim, self.num_attention_heads = heads * HEAD_DIM, HEAD_DIM, heads
        self.num_key_value_heads, self.rope_theta = max(1, heads // 8), 10000.0


def dense(attention: Attention, q, keys, values):
    length = q.shape[2]
    mask = torch.cat([causal_mask(length)] + [torch.eye(length, dtype=torch.bool)] * (len(keys) - 1), dim=1)
    return attention.attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), mask)


def measure(fn) -> tuple[float, float]:
    """(seconds, peak GiB allocated) of fn() and the backward of its sum."""
    tracker = AllocationPeak()
    start = time.perf_counter()
    with tracker:
        fn().sum().backward()
    return time.perf_counter() - start, tracker.peak / 2**30


def attention_benchmark(seq: int, steps: int, heads: int) -> None:
    attention = Attention(Tiny(heads))
    kv = attention.kv_heads
    generator = torch.Generator().manual_seed(0)
    q = [torch.randn(1, heads, seq, HEAD_DIM, generator=generator, requires_grad=True) for _ in range(steps)]
    keys = [torch.randn(1, kv, seq, HEAD_DIM, generator=generator, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(1, kv, seq, HEAD_DIM, generator=generator, requires_grad=True) for _ in range(steps)]

    def every_step(form):
        return lambda: sum(form(q[k], keys[: k + 1], values[: k + 1]).sum() for k in range(steps))

    with torch.no_grad():  # the two forms agree (the tests pin it at 1e-12 in float64)
        difference = (dense(attention, q[-1], keys, values) - attention.attend_ttt(q[-1], keys, values)).abs().max()
    dense_s, dense_gib = measure(every_step(lambda *a: dense(attention, *a)))
    chunk_s, chunk_gib = measure(every_step(attention.attend_ttt))
    dense_entries = sum((k + 1) * seq * seq for k in range(steps))
    rows = ttt_chunk_rows(seq)
    chunks = range(0, seq, rows)
    chunk_entries = sum(min(rows, seq - s) * (min(s + rows, seq) + k * min(rows, seq - s))
                        for k in range(steps) for s in chunks)
    print(f"TTT attention, T {seq}, K {steps}, {heads} heads x {HEAD_DIM} ({kv} kv), float32, forward + backward of all steps:")
    print(f"  dense [T, (k+1)T] mask: {dense_s:7.2f} s, peak {dense_gib:6.2f} GiB, {dense_entries / 1e6:8.1f} M entries per head")
    print(f"  query chunks of {rows}:    {chunk_s:7.2f} s, peak {chunk_gib:6.2f} GiB, {chunk_entries / 1e6:8.1f} M entries per head")
    print(f"  ratio dense / chunks: time {dense_s / chunk_s:.2f}x, peak memory {dense_gib / chunk_gib:.2f}x, "
          f"entries {dense_entries / chunk_entries:.2f}x; max |difference| {difference:.2e}")


def full_teacher(last, lm_head, hot):
    logits = last @ lm_head.T  # [T, V]
    return logits.argmax(-1), logits[..., hot].float().softmax(-1)


def teacher_benchmark(tokens: int) -> None:
    generator = torch.Generator().manual_seed(1)
    lm_head = torch.randn(KIMI_VOCAB, KIMI_HIDDEN, generator=generator) * 0.02
    hot = torch.sort(torch.randperm(KIMI_VOCAB, generator=generator)[:KIMI_DRAFT_VOCAB]).values
    last = torch.randn(1, tokens, KIMI_HIDDEN, generator=generator)
    head = TeacherHead(lm_head, hot)
    results = {}
    for name, fn in (("full", lambda: full_teacher(last, lm_head, hot)), ("compact", lambda: head(last))):
        tracker = AllocationPeak()
        start = time.perf_counter()
        with torch.no_grad(), tracker:
            results[name] = fn()
        results[name + "_s"], results[name + "_gib"] = time.perf_counter() - start, tracker.peak / 2**30
    same_argmax = torch.equal(results["full"][0], results["compact"].argmax)
    probs = (results["full"][1] - results["compact"].probs).abs().max()
    full_bf16_gib = 8 * 4096 * KIMI_VOCAB * 2 / 2**30
    print(f"teacher, {tokens} tokens, V {KIMI_VOCAB}, draft vocabulary {KIMI_DRAFT_VOCAB}, hidden {KIMI_HIDDEN}, float32:")
    print(f"  full logits:   {results['full_s']:6.2f} s, peak {results['full_gib']:6.2f} GiB")
    print(f"  compact:       {results['compact_s']:6.2f} s, peak {results['compact_gib']:6.2f} GiB")
    print(f"  ratio full / compact: time {results['full_s'] / results['compact_s']:.2f}x, peak memory "
          f"{results['full_gib'] / results['compact_gib']:.2f}x; argmax equal: {same_argmax}, max |prob difference| {probs:.1e}")
    print(f"  at 8 x 4,096 tokens per rank the full bf16 logits alone take {full_bf16_gib:.1f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024, help="teacher tokens")
    args = parser.parse_args()
    torch.manual_seed(0)
    attention_benchmark(args.seq, args.steps, args.heads)
    teacher_benchmark(args.tokens)


if __name__ == "__main__":
    main()
