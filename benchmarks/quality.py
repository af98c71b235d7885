"""Data-quality report throughput: replies and generated tokens per second through eagle3.data.quality's meter
(synthetic replies of Kimi-sized ids, decoding left out), and what that means for the Kimi-K2.5 config's data.

    python benchmarks/quality.py [--replies 2000] [--length 2048]
"""

from __future__ import annotations

import argparse
import random
import resource
import time
from pathlib import Path

from eagle3.resolve import load_config
from eagle3.data.quality import Meter, Reply

ROOT = Path(__file__).resolve().parent.parent
KIMI_VOCAB = 163_840


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--replies", type=int, default=2000)
    parser.add_argument("--length", type=int, default=2048, help="generated tokens per reply")
    args = parser.parse_args()
    rng = random.Random(0)
    replies = [Reply(tuple(rng.randrange(KIMI_VOCAB) for _ in range(args.length)), "text", False)
               for _ in range(args.replies)]
    meter = Meter()
    start = time.perf_counter()
    for reply in replies:
        meter.add(reply)
    meter.figures()
    seconds = time.perf_counter() - start
    tokens = args.replies * args.length
    print(f"meter: {args.replies:,} replies x {args.length:,} tokens in {seconds:.2f} s: "
          f"{args.replies / seconds:,.0f} replies/s, {tokens / seconds / 1e6:.2f} M tokens/s (one core)")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB (replies held by the benchmark "
          "itself; the meter keeps counters, one digest and 16 ids per reply)")
    kimi = load_config(ROOT / "configs" / "kimi-k25-8xh200.yaml")
    generated = kimi.data.num_samples * kimi.data.max_new_tokens  # at most: every reply at the cap
    print(f"Kimi-K2.5 config: {kimi.data.num_samples:,} samples x at most {kimi.data.max_new_tokens:,} generated "
          f"tokens = {generated / 1e6:,.0f} M tokens -> at most {generated / (tokens / seconds) / 60:,.1f} min of "
          "metering (plus reading the JSONL and decoding each reply once)")


if __name__ == "__main__":
    main()
