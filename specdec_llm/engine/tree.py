"""Token trees: a row's proposal as several branches, verified by one target forward.

A tree is ``tokens`` with ``parents``: node i follows node ``parents[i]``, or the row's last
token when it is -1; parents come before their children, so a chain is ``parents = [-1, 0,
1, ...]``. The verification feeds [last] + tokens; each node attends to the row's prefix, its
ancestors and itself (``ancestry``), at the position its depth gives. Rows of the target's
logits: 0 for the last token, i + 1 for node i.

Acceptance walks from the root: greedy follows the child that is the target's argmax;
sampled rows with deterministic drafts (prompt lookup, the suffix index) use multi-draft
rejection sampling (SpecInfer, Miao et al. 2024, with one-hot drafts): each child is accepted
with the probability the remaining distribution gives it, a rejected child's token is removed
from that distribution, and when no child is accepted the token is drawn from what remains.
Both keep the target's output exactly (greedy: identical; sampled: its distribution).
"""

from __future__ import annotations

import torch

from .sampling import sample


def depths(parents: list[int]) -> list[int]:
    """Each node's depth (the root's children are at 1)."""
    out: list[int] = []
    for p in parents:
        assert p < len(out), "a parent must come before its children"
        out.append(1 if p < 0 else out[p] + 1)
    return out


def ancestry(parents: list[int]) -> torch.Tensor:
    """[n + 1, n + 1] bool over [root] + nodes: entry (i, j) when j is i or one of its ancestors."""
    n = len(parents)
    seen = torch.eye(n + 1, dtype=torch.bool)
    seen[:, 0] = True
    for i, p in enumerate(parents):
        if p >= 0:
            seen[i + 1] |= seen[p + 1]
    return seen


def children(parents: list[int], node: int) -> list[int]:
    return [i for i, p in enumerate(parents) if p == node]


def accept_greedy(tokens: list[int], parents: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    """(the accepted path's nodes, the target's next token) under greedy decoding."""
    best = logits.argmax(-1).tolist()
    path: list[int] = []
    node = -1
    while True:
        nxt = next((c for c in children(parents, node) if tokens[c] == best[node + 1]), None)
        if nxt is None:
            return path, best[node + 1]
        path.append(nxt)
        node = nxt


def accept_sampled(
    tokens: list[int], parents: list[int], p: torch.Tensor, generator: torch.Generator
) -> tuple[list[int], int]:
    """(the accepted path's nodes, the next token) for deterministic drafts; ``p`` [n + 1, V]
    the target's processed probabilities at [root] + nodes. Siblings must differ."""
    path: list[int] = []
    node = -1
    while True:
        rest = p[node + 1].clone()
        for c in children(parents, node):
            if float(torch.rand((), generator=generator)) * float(rest.sum()) < float(rest[tokens[c]]):
                path.append(c)
                node = c
                break
            rest[tokens[c]] = 0.0
        else:
            return path, sample(rest / rest.sum(), generator)


def chain_parents(n: int) -> list[int]:
    """The parents of a chain of ``n`` tokens."""
    return list(range(-1, n - 1))
