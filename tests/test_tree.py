"""Tree drafting and verification (eagle3.model.tree): the tree SGLang would draft, and sampled verification
that keeps the target's distribution - on synthetic distributions and through the reference server's decoding
on the micro target."""

import collections

import pytest
import torch

from drafts import TARGET_VOCAB, tiny_config
from eagle3.algorithms.eagle3.model import Eagle3Draft
from eagle3.model.blocks import causal_mask, init_weights
from eagle3.model.tree import DraftTree, ROOT, tree_attention, walk_greedy, walk_sampled
from eagle3.algorithms.eagle3.tree import DraftCache, draft_tree
from eagle3.algorithms.eagle3.served import draft_as_served
from eagle3.algorithms import EAGLE3
from eagle3.serve.reference import Served, decode
from eagle3.shape import DraftShape
from fixtures_tiny import one_torch_thread
from helpers import RELEASE


VOCAB = 6
# root -> a(2), b(4); a -> c(2), d(5); b -> e(1): node i has token TREE.tokens[i]
TREE = DraftTree(tokens=[2, 4, 2, 5, 1], parents=[ROOT, ROOT, 0, 0, 1])


def distribution(context: tuple[int, ...]) -> torch.Tensor:
    """A fixed, uneven target distribution over VOCAB tokens after each context."""
    generator = torch.Generator().manual_seed(hash(context) % (1 << 31))
    return (torch.rand(VOCAB, generator=generator) * 3).softmax(-1)


def path_tokens(tree: DraftTree, node: int) -> tuple[int, ...]:
    tokens = []
    while node != ROOT:
        tokens.append(tree.tokens[node])
        node = tree.parents[node]
    return tuple(reversed(tokens))


def total_variation(counts: collections.Counter, expected: torch.Tensor) -> float:
    n = sum(counts.values())
    return 0.5 * sum(abs(counts.get(t, 0) / n - float(p)) for t, p in enumerate(expected))


def test_the_tree_mask_shows_each_node_the_prefix_and_its_ancestors():
    positions, visible = tree_attention(3, TREE)
    assert positions.tolist() == [0, 1, 2, 3, 3, 4, 4, 4]  # depth 1 at P, depth 2 at P + 1 (node 4 is b's child)
    assert visible[:3, :3].tolist() == torch.ones(3, 3, dtype=torch.bool).tril().tolist()
    assert visible[3:, :3].all()
    assert visible[3 + 3, 3:].tolist() == [True, False, False, True, False]  # d sees a and itself
    assert visible[3 + 4, 3:].tolist() == [False, True, False, False, True]  # e sees b and itself


def test_greedy_walk_follows_the_targets_argmax_and_prunes_broken_tokens():
    argmax = {ROOT: 2, 0: 5, 3: 0}  # after the root 2 (node a), after a 5 (node d), after d nothing drafted
    assert walk_greedy(TREE, lambda node: argmax[node], max_depth=3) == [0, 3]
    assert walk_greedy(TREE, lambda node: argmax[node], max_depth=1) == [0]
    broken = DraftTree([2, 9000, 7], [ROOT, ROOT, 1]).pruned(vocab_size=100)
    assert broken == DraftTree([2], [ROOT])  # the out-of-vocabulary node and its child go


def test_sampled_verification_emits_the_targets_distribution():
    """Tolerance: total variation 0.02 over 30,000 walks (seed 0); the sampling noise is ~0.005, while a walk
    that forgot to remove the rejected children from the final distribution is off by ~0.1."""
    generator = torch.Generator().manual_seed(0)
    first, second = collections.Counter(), collections.defaultdict(collections.Counter)
    accepted = 0
    for _ in range(30_000):
        path, bonus = walk_sampled(TREE, lambda node: distribution(path_tokens(TREE, node)), generator, max_depth=2)
        emitted = [TREE.tokens[n] for n in path] + [bonus]
        first[emitted[0]] += 1
        if path:  # the second token follows an accepted node: distributed as the target's after it
            second[emitted[0]][emitted[1]] += 1
        accepted += len(path)
    assert total_variation(first, distribution(())) < 0.02
    for token, counts in second.items():
        assert total_variation(counts, distribution((token,))) < 0.02
    assert accepted > 10_000  # the draft nodes were accepted often: the acceptance path was exercised


def test_sampled_speculative_decoding_on_the_micro_target_keeps_its_distribution(micro, drafts):
    """The second token of a reply is the first one a verify step emits. Its distribution over 1,500 requests
    (temperature 0.3, seed 0) against the target's exact marginal Σ p(x1) p(x2 | x1), on the tokens holding
    90% of the mass (nine) plus one bucket for the rest: total variation under 0.07 (the noise at this size is
    ~0.03)."""
    draft = draft_as_served(drafts["good"], RELEASE, micro["embed"]).eval()
    served = Served(micro["model"], None, frozenset(), draft, EAGLE3, DraftShape(2, 3, 5), RELEASE,
                    torch.Generator().manual_seed(0))
    prompt, temperature = micro["prompts"][2], 0.3
    with one_torch_thread(), torch.no_grad():
        logits = micro["model"](torch.tensor([prompt])).logits[0, -1]
        p_first = (logits / temperature).softmax(-1)  # [V]
        likely = p_first.argsort(descending=True)[: int((p_first.cumsum(0) < 0.999).sum()) + 1]
        batch = torch.tensor([prompt + [int(t)] for t in likely])
        p_second = (micro["model"](batch).logits[:, -1] / temperature).softmax(-1)  # [k, V]
        marginal = (p_first[likely, None] * p_second).sum(0) / p_first[likely].sum()
        replies = [decode(served, prompt, 2, temperature) for _ in range(1500)]
    seconds = collections.Counter(reply.output[1] for reply in replies)
    kept = marginal.argsort(descending=True)[: int((marginal.sort(descending=True).values.cumsum(0) < 0.9).sum()) + 1]
    bucket = {int(t): i for i, t in enumerate(kept)}
    expected = torch.cat([marginal[kept], (1 - marginal[kept].sum()).view(1)])
    observed = collections.Counter({bucket.get(t, len(kept)): 0 for t in seconds})
    for token, n in seconds.items():
        observed[bucket.get(token, len(kept))] += n
    assert total_variation(observed, expected) < 0.07
    assert sum(reply.correct for reply in replies) > 300  # drafts were accepted: the speculative path decided


@pytest.mark.parametrize("shape", [DraftShape(3), DraftShape(3, 4, 8), DraftShape(4, 2, 10)])
def test_tree_shapes_sglang_accepts(shape):
    assert shape.drafts_per_step == shape.num_draft_tokens - 1


@pytest.mark.parametrize("args, field", [((3, 1, 6), "num_steps + 1"), ((2, 2, 8), "[2, 7]"), ((0, 1, 1), "at least 1")])
def test_tree_shapes_sglang_refuses_are_named(args, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("+", r"\+")):
        DraftShape(*args)


def random_draft(seed: int = 0) -> Eagle3Draft:
    config = tiny_config(torch_dtype="float32")
    draft = Eagle3Draft(config, torch.randn(TARGET_VOCAB, config.hidden_size, generator=torch.Generator().manual_seed(seed)))
    init_weights(draft, seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.mul_(10)  # peaked distributions, so the trees differ from prefix to prefix
    return draft.eval()


@torch.no_grad()
def test_the_cached_root_equals_a_full_causal_pass_over_the_prefix():
    """The cache projects each position once and queries only the last: the same logits as projecting the whole
    prefix and attending causally, at every length it grows through (one position, then several at once)."""
    draft = random_draft()
    generator = torch.Generator().manual_seed(1)
    aux = torch.randn(40, 3 * 32, generator=generator)  # [T, n_aux * TH]
    tokens = torch.randint(0, TARGET_VOCAB, (41,), generator=generator)
    cache = DraftCache(draft)
    for length in (1, 2, 3, 7, 8, 20, 40):
        cache.extend(aux[:length], tokens[: length + 1])
        hidden = draft.fc(aux[None, :length])
        q, k, v = draft.project(tokens[None, 1 : length + 1], hidden, torch.arange(length))
        _, full = draft.finish(hidden, draft.midlayer.self_attn.attend(q, k, v, causal_mask(length)))
        torch.testing.assert_close(cache.root()[1], full[0, -1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [DraftShape(3), DraftShape(3, 4, 8)])
def test_a_request_drafts_the_same_trees_with_its_cache_as_from_scratch(shape):
    draft = random_draft(2)
    generator = torch.Generator().manual_seed(3)
    aux = torch.randn(30, 3 * 32, generator=generator)
    tokens = torch.randint(0, TARGET_VOCAB, (31,), generator=generator)
    cache, trees = DraftCache(draft), set()
    for length in (5, 6, 9, 10, 14, 30):
        cached = draft_tree(draft, aux[:length], tokens[: length + 1], shape, cache)
        assert cached == draft_tree(draft, aux[:length], tokens[: length + 1], shape)
        trees.add(tuple(cached.tokens))
    assert len(trees) > 1  # the prefixes draft different trees: the comparison could fail
    with pytest.raises(ValueError, match="shrank from 30 to 29"):
        cache.extend(aux[:29], tokens[:30])
