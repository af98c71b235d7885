"""The acceptance replay with the draft's incremental cache against projecting the prefix from scratch.

The trainer's evaluation and `eagle3 simulate` replay drafting over stored greedy sequences: at every verify step
the draft drafts a tree after the verified prefix. With a DraftCache kept across a request's verify steps (what
serving's KV cache does), each step projects only the positions it added; from scratch, every step projects the
whole prefix again, so a T-token replay costs O(T^2) draft rows instead of O(T).

Both run the same replay (`eagle3.bench.simulate.replay`) over a random sequence with a random draft: the counts
must be equal, and the script says so. Sizes: the tiny config's draft (hidden 128) and a wider one.

    OMP_NUM_THREADS=1 python benchmarks/replay.py [--tokens 512] [--prompt 64] [--hidden 128 512]
"""

from __future__ import annotations

import argparse
import time

import torch

from eagle3.bench.simulate import replay
from eagle3.algorithms.eagle3.checkpoint import DraftConfig
from eagle3.algorithms.eagle3.model import Eagle3Draft
from eagle3.model.blocks import init_weights
from eagle3.algorithms.eagle3.tree import DraftCache, draft_tree
from eagle3.shape import DraftShape

VOCAB, DRAFT_VOCAB, AUX = 2048, 1024, 3


def random_draft(hidden: int) -> Eagle3Draft:
    config = DraftConfig(hidden_size=hidden, target_hidden_size=hidden, intermediate_size=2 * hidden,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-6,
                         rope_theta=10000.0, max_position_embeddings=8192, vocab_size=VOCAB,
                         draft_vocab_size=DRAFT_VOCAB, torch_dtype="float32", aux_layers=[0, 1, 2],
                         target_num_hidden_layers=4)
    draft = Eagle3Draft(config, torch.randn(VOCAB, hidden))
    init_weights(draft, 0)
    return draft.eval()


@torch.no_grad()
def timed_replay(draft: Eagle3Draft, seq: list[int], aux: torch.Tensor, prompt: int, shape: DraftShape,
                 cached: bool) -> tuple[float, tuple[int, int]]:
    tokens, cache = torch.tensor(seq), DraftCache(draft) if cached else None
    propose = lambda p: draft_tree(draft, aux[:p], tokens[: p + 1], shape, cache)  # noqa: E731
    start = time.perf_counter()
    row = replay(seq, prompt, propose, shape.num_steps, len(seq) - prompt - shape.num_steps - 1, frozenset(), None)
    return time.perf_counter() - start, (row.completion_tokens, row.verify_ct)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=512, help="sequence length (prompt + continuation)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 512])
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    seq = torch.randint(0, VOCAB, (args.tokens,), generator=generator).tolist()
    print(f"replay of {args.tokens} tokens ({args.prompt} prompt), {torch.get_num_threads()} thread(s)")
    for hidden in args.hidden:
        draft = random_draft(hidden)
        aux = torch.randn(args.tokens, AUX * hidden, generator=generator)
        for shape in (DraftShape(3), DraftShape(3, 4, 8)):
            scratch, scratch_counts = timed_replay(draft, seq, aux, args.prompt, shape, cached=False)
            cached, cached_counts = timed_replay(draft, seq, aux, args.prompt, shape, cached=True)
            same = "same counts" if scratch_counts == cached_counts else f"COUNTS DIFFER {scratch_counts} {cached_counts}"
            print(f"  hidden {hidden:4d} shape {shape.num_steps},{shape.eagle_topk},{shape.num_draft_tokens}: "
                  f"from scratch {scratch:6.2f} s, cached {cached:6.2f} s, ratio {scratch / cached:5.1f}x ({same})")


if __name__ == "__main__":
    main()
