"""Draft trees and their verification as SGLang does them (`--speculative-eagle-topk` K, `--speculative-num-steps` S,
`--speculative-num-draft-tokens` N); a chain is the tree with K = 1. How a draft makes its tree is its algorithm's
(EAGLE-3's: eagle3/algorithms/eagle3/tree.py).

Verification (SGLang's `verify_tree_greedy` and `tree_speculative_sampling_target_only` kernels): the target
scores every node in one forward (each node sees the prefix and its ancestors). From the root, the first child
that passes is accepted and the walk goes on from it:
- greedy: the child whose token is the target's argmax;
- sampling: one uniform coin per node; the children are tried in order, accumulating the target's
  probabilities of their tokens, and the child at which the coin falls under the sum is accepted. The token
  after the last accepted node is then sampled from the target's distribution without the children tried
  there. Output tokens follow the target's distribution exactly (the draft's probabilities are not used).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from eagle3.model.blocks import causal_mask

ROOT = -1  # the last verified token, whose children are the first drafted position


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]  # [N - 1] target ids of the draft nodes, parents before children
    parents: list[int]  # [N - 1] each node's parent node, ROOT for the first drafted position

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), list(range(ROOT, len(tokens) - 1)))

    def children(self, node: int) -> list[int]:
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def depth(self, node: int) -> int:
        """1 for the root's children."""
        return 0 if node == ROOT else 1 + self.depth(self.parents[node])

    def pruned(self, vocab_size: int) -> DraftTree:
        """Without nodes outside the target vocabulary (a broken d2t) and their descendants: the target never
        emits them, so they can never be accepted."""
        keep, index = [], {ROOT: ROOT}
        for node, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if 0 <= token < vocab_size and parent in index:
                index[node] = len(keep)
                keep.append(node)
        return DraftTree([self.tokens[n] for n in keep], [index[self.parents[n]] for n in keep])


def walk_greedy(tree: DraftTree, next_token: Callable[[int], int], max_depth: int) -> list[int]:
    """The accepted nodes, root to leaf: at each node the child holding next_token(node) (the target's argmax
    after it), at most max_depth deep."""
    path, node = [], ROOT
    while len(path) < max_depth:
        wanted = next_token(node)
        node = next((c for c in tree.children(node) if tree.tokens[c] == wanted), None)
        if node is None:
            break
        path.append(node)
    return path


def walk_sampled(tree: DraftTree, probs: Callable[[int], torch.Tensor], generator: torch.Generator,
                 max_depth: int) -> tuple[list[int], int]:
    """(accepted nodes, the token sampled after the last one). probs(node) [V]: the target's distribution after
    `node` at the request's temperature."""
    path, node, tried = [], ROOT, []
    while len(path) < max_depth:
        coin, mass, tried = float(torch.rand((), generator=generator)), 0.0, []
        accepted, here = None, probs(node)  # [V], once per node: its children are tried against it
        for child in tree.children(node):
            mass += float(here[tree.tokens[child]])
            if coin <= mass:
                accepted = child
                break
            tried.append(tree.tokens[child])
        if accepted is None:
            break
        path.append(accepted)
        node, tried = accepted, []
    residual = probs(node).clone()  # [V]
    residual[tried] = 0.0  # the children rejected here; none when the walk stopped on depth or at a leaf
    return path, int(torch.multinomial(residual, 1, generator=generator))


def tree_attention(prefix_len: int, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's verify forward over prefix + nodes: position ids [P + N] and the visibility mask
    [P + N, P + N] (True = visible): the prefix causally, each node the whole prefix, its ancestors and itself."""
    n = len(tree.tokens)
    positions = list(range(prefix_len)) + [prefix_len - 1 + tree.depth(node) for node in range(n)]
    mask = torch.zeros(prefix_len + n, prefix_len + n, dtype=torch.bool)
    mask[:prefix_len, :prefix_len] = causal_mask(prefix_len)
    mask[prefix_len:, :prefix_len] = True
    for node in range(n):
        ancestor = node
        while ancestor != ROOT:
            mask[prefix_len + node, prefix_len + ancestor] = True
            ancestor = tree.parents[ancestor]
    return torch.tensor(positions), mask
