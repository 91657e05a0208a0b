"""Token trees (engine/tree.py): one forward over every branch of every row gives each node the
logits a plain forward of its own path gives, and tree acceptance keeps the target's output."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from helpers import TV_BOUND

from specdec_llm.engine import tree
from specdec_llm.engine.ragged import RaggedCache
from specdec_llm.engine.sampling import accept_greedy

# [root] + 6 nodes: two branches from the root, one of them forking again
TOKENS = [7, 8, 9, 10, 11, 12]
PARENTS = [-1, 0, 0, -1, 3, 1]


def test_depths_and_ancestry():
    assert tree.depths(PARENTS) == [1, 2, 2, 1, 2, 3]
    seen = tree.ancestry(PARENTS)
    assert seen[6].nonzero().flatten().tolist() == [0, 1, 2, 6]  # node 5: root, node 0, node 1, itself
    assert seen[4].nonzero().flatten().tolist() == [0, 4]
    assert tree.ancestry(tree.chain(4)).equal(torch.ones(5, 5, dtype=torch.bool).tril())


def path_to(node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = PARENTS[node]
    return out[::-1]


@torch.inference_mode()
def test_one_forward_over_a_tree_gives_every_node_its_own_paths_logits():
    model = tiny_llama(3, vocab=64)
    prompts = [[1, 2, 3, 4, 5], [6, 5, 4]]  # rows of different lengths: ragged
    cache = RaggedCache(model, 0)
    cache.extend([one(model, p) for p in prompts])
    cache.drop(0, [4])  # a hole in row 0 (a rolled-back token): its logical positions skip it
    seqs = [[1, 2, 3, 4], [6, 5, 4]]
    last = [20, 21]
    logits = cache.forward([[last[b]] + TOKENS for b in range(2)], 1 + len(TOKENS), trees={0: PARENTS, 1: PARENTS})
    for b in range(2):
        plain = model(torch.tensor([seqs[b] + [last[b]]])).logits[0, -1]
        assert torch.allclose(logits[b, 0], plain, atol=1e-4)
        for node in range(len(TOKENS)):
            ids = seqs[b] + [last[b]] + [TOKENS[i] for i in path_to(node)]
            ref = model(torch.tensor([ids])).logits[0, -1]
            assert torch.allclose(logits[b, node + 1], ref, atol=1e-4), (b, node)
    # keep the path to node 5, drop the other branches: the next step sees exactly that path
    start = cache.width - len(TOKENS)
    for b in range(2):
        cache.drop(b, [start + i for i in range(len(TOKENS)) if i not in path_to(5)])
    nxt = cache.forward([[30], [31]], 1)
    for b in range(2):
        ids = seqs[b] + [last[b]] + [TOKENS[i] for i in path_to(5)] + [30 + b]
        assert torch.allclose(nxt[b, 0], model(torch.tensor([ids])).logits[0, -1], atol=1e-4)


def one(model, prompt: list[int]) -> RaggedCache:
    c = RaggedCache(model, 1)
    c.forward([prompt], 1)
    return c


def test_greedy_tree_acceptance_follows_the_targets_argmax():
    logits = torch.full((7, 16), -1.0)
    for row, best in enumerate([7, 9, 0, 0, 0, 0, 0]):  # root -> 7 (node 0) -> 9 (node 2) -> 0: no child
        logits[row, best] = 1.0
    assert tree.accept_greedy(TOKENS, PARENTS, logits) == ([0, 2], 0)
    chain_logits = logits[[0, 1, 2]]
    assert tree.accept_greedy([7, 8], tree.chain(2), chain_logits) == ([0], accept_greedy([7, 8], chain_logits)[1])


@pytest.mark.parametrize("siblings", [[3], [3, 5], [5, 3, 6]])
def test_sampled_tree_acceptance_keeps_the_targets_distribution(siblings):
    V, n = 8, 40_000
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, V, generator=gen) * 1.5, -1)
    parents = [-1] * len(siblings)
    counts = torch.zeros(V)
    for _ in range(n):
        path, nxt = tree.accept_sampled(siblings, parents, p[[0] * (1 + len(siblings))], gen)
        counts[siblings[path[0]] if path else nxt] += 1
    tv = float(0.5 * (counts / n - p[0]).abs().sum())
    assert tv < TV_BOUND / 2, tv
