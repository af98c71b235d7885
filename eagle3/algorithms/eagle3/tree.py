"""EAGLE-3's tree drafting as SGLang does it for EAGLE (`--speculative-eagle-topk` K, `--speculative-num-steps` S,
`--speculative-num-draft-tokens` N); a chain is the tree with K = 1. The tree and its verification are every draft's
(eagle3/model/tree.py).

Drafting (read from SGLang's `draft_forward`, `select_top_k_tokens`, `organize_draft_results`):
- the draft's forward over the verified prefix gives the root's K most probable tokens (softmax over the
  draft vocabulary); a candidate's score is the product of the probabilities along its path;
- each of the S - 1 further steps runs K branch slots: each expands its input into K children, and the K best
  of the K * K children by score become the next step's inputs. A slot's input carries its parent's output
  hidden state, but its attention sees the prefix and the entries that SLOT wrote at earlier steps (SGLang keeps
  one cache row per slot and never reorders it by parent);
- of all K + (S - 1) * K * K candidates the N - 1 best by score form the tree, in candidate order (a parent
  always comes before its children).
"""

from __future__ import annotations

import torch

from eagle3.algorithms.eagle3.model import Eagle3Draft
from eagle3.model.tree import ROOT, DraftTree
from eagle3.shape import DraftShape


class DraftCache:
    """The draft's keys and values over a request's verified prefix, grown as the prefix grows (serving's KV
    cache): each verify step projects only the positions it adds, and the root's logits take one query, so a
    replay costs O(T) draft rows instead of O(T^2)."""

    def __init__(self, model: Eagle3Draft):
        self.model = model
        self.keys: torch.Tensor | None = None  # [1, kv_heads, P, d]
        self.values: torch.Tensor | None = None  # [1, kv_heads, P, d]
        self.query: torch.Tensor | None = None  # [1, heads, 1, d]: the last position's
        self.hidden: torch.Tensor | None = None  # [1, 1, H]: the last position's fused target features

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def extend(self, aux: torch.Tensor, tokens: torch.Tensor) -> None:
        """Cache the positions of a verified prefix (aux [P, n_aux * TH], tokens [P + 1]) not cached yet."""
        start, length = self.length, aux.shape[0]
        if length < start:
            raise ValueError(f"the verified prefix shrank from {start} to {length} positions: one cache per request")
        if length == start:
            return
        hidden = self.model.fuse(aux[None, start:])  # [1, new, H]
        positions = torch.arange(start, length, device=aux.device)
        q, k, v = self.model.project(tokens[None, start + 1 : length + 1], hidden, positions)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        self.query, self.hidden = q[:, :, -1:], hidden[:, -1:]

    def root(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The last verified position's pre-norm output [1, 1, H] and logits [Dv]: it sees the whole prefix."""
        visible = torch.ones(1, self.length, dtype=torch.bool, device=self.keys.device)
        attended = self.model.midlayer.self_attn.attend(self.query, self.keys, self.values, visible)
        hidden, logits = self.model.finish(self.hidden, attended)
        return hidden, logits[0, -1]


@torch.no_grad()
def draft_tree(model: Eagle3Draft, aux: torch.Tensor, tokens: torch.Tensor, shape: DraftShape,
               cache: DraftCache | None = None) -> DraftTree:
    """The draft tree after a verified prefix. aux [P, n_aux * TH]: target features of positions 0..P-1;
    tokens [P + 1]: x_0..x_P, where x_P is the last verified token. `cache`: the request's DraftCache, kept
    across its verify steps (None: the prefix is projected from scratch)."""
    steps, topk = shape.num_steps, shape.eagle_topk
    length, device = aux.shape[0], aux.device
    attention, hot = model.midlayer.self_attn, model.hot_token_ids()
    vocab = model.embed_tokens.num_embeddings
    cache = cache if cache is not None else DraftCache(model)
    cache.extend(aux, tokens.to(device))
    prefix_k, prefix_v = cache.keys, cache.values
    hidden, root_logits = cache.root()  # [1, 1, H], [Dv]
    top_p, top_i = root_logits.float().softmax(-1).topk(topk)  # [K]
    scores, ids, parents = [top_p], [hot[top_i]], [torch.full((topk,), ROOT, device=device)]
    slot_score, slot_node, slot_token = top_p, torch.arange(topk, device=device), hot[top_i]  # [K] each
    slot_hidden = hidden[:, -1:].expand(topk, 1, -1)  # [K, 1, H]: the parent's output
    slot_k, slot_v = [], []  # per step [K, kv_heads, 1, d]: what each slot wrote
    for i in range(1, steps):
        position = torch.tensor([length - 1 + i], device=device)
        q, k, v = model.project(slot_token.clamp(0, vocab - 1).view(topk, 1), slot_hidden, position)
        slot_k.append(k)
        slot_v.append(v)
        keys = torch.cat([prefix_k.expand(topk, -1, -1, -1), *slot_k], dim=2)
        values = torch.cat([prefix_v.expand(topk, -1, -1, -1), *slot_v], dim=2)
        visible = torch.ones(1, length + i, dtype=torch.bool, device=device)
        out, logits = model.finish(slot_hidden, attention.attend(q, keys, values, visible))  # [K, 1, H], [K, 1, Dv]
        child_p, child_i = logits[:, -1].float().softmax(-1).topk(topk)  # [K, K]
        expanded = (slot_score[:, None] * child_p).flatten()  # [K * K]
        first = sum(len(s) for s in scores)
        scores.append(expanded)
        ids.append(hot[child_i].flatten())
        parents.append(slot_node.repeat_interleave(topk))
        best = best_first(expanded)[:topk]
        slot_score, slot_node, slot_token = expanded[best], first + best, ids[-1][best]
        slot_hidden = out[best // topk]
    chosen = best_first(torch.cat(scores))[: shape.drafts_per_step].sort().values
    all_ids, all_parents = torch.cat(ids), torch.cat(parents)
    index = {ROOT: ROOT} | {int(c): n for n, c in enumerate(chosen)}
    return DraftTree([int(all_ids[c]) for c in chosen], [index[int(all_parents[c])] for c in chosen])


def best_first(scores: torch.Tensor) -> torch.Tensor:
    """Indices by descending score; ties keep the lower index first, so a parent (whose score is never below
    its children's) is chosen before them."""
    return torch.sort(scores, descending=True, stable=True).indices
