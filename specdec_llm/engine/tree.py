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

Shape (``grow``): the plan's proposal for a row is its chain; the other drafters' offers for
the row join it as branches, each where it leaves the tree, as far as it pays. A node's
chance of being accepted is its parent's times its own acceptance estimate times what its
earlier siblings leave (greedy: one child at most is the target's token); the tokens a tree
is expected to give are one plus the sum of those chances. A branch's tail is kept up to the
length whose expected tokens are worth more than the wider verification costs (the cost
model's measured verify seconds per width), at most ``limit`` nodes in all; where nothing
pays, the chain is the tree of width 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from .drafting.base import Proposal
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


def grow(
    chain: Proposal, offers: Iterable[Proposal], price: Callable[[int], float], token_s: float, limit: int
) -> Proposal:
    """``chain`` with the branches of ``offers`` that pay: ``price(w)`` the seconds of a
    verification of ``w`` drafts, ``token_s`` what one more token per iteration is worth."""
    tokens, accept = list(chain.tokens), list(chain.accept) or [0.0] * len(chain.tokens)
    parents = list(chain.parents) if chain.parents is not None else chain_parents(len(tokens))
    reach: list[float] = []
    for i, a in enumerate(accept):
        reach.append((reach[parents[i]] if parents[i] >= 0 else 1.0) * a)
    for offer in sorted(offers, key=lambda o: -o.expected(len(o.tokens))):
        node, d = -1, 0  # walk the tree along the offer: it forks where the tree has no such child
        while d < len(offer.tokens):
            nxt = next((c for c in children(parents, node) if tokens[c] == offer.tokens[d]), None)
            if nxt is None:
                break
            node, d = nxt, d + 1
        room = limit - len(tokens)
        if d == len(offer.tokens) or room <= 0:
            continue
        base = reach[node] if node >= 0 else 1.0
        left = max(0.0, 1.0 - sum(reach[c] for c in children(parents, node)) / max(base, 1e-9))
        tail, chances, run = offer.tokens[d : d + room], [], base * left
        for a in (offer.accept[d:] or [0.0])[: len(tail)]:
            run *= a
            chances.append(run)
        best, best_net, gain = 0, 0.0, 0.0
        for j, c in enumerate(chances, 1):
            gain += c
            net = gain * token_s - (price(len(tokens) + j) - price(len(tokens)))
            if net > best_net:
                best, best_net = j, net
        for j in range(best):
            parents.append(node if j == 0 else len(tokens) - 1)
            tokens.append(tail[j])
            accept.append(offer.accept[d + j])
            reach.append(chances[j])
    if len(tokens) == len(chain.tokens):
        return chain
    return Proposal(
        chain.drafter, tokens, None, accept, [*chain.buckets, *[None] * (len(tokens) - len(chain.tokens))], parents
    )


def expected(prop: Proposal) -> float:
    """Tokens one verification of ``prop`` (a chain or a tree) is expected to give."""
    parents = prop.parents if prop.parents is not None else chain_parents(len(prop.tokens))
    reach: list[float] = []
    for i, a in enumerate(prop.accept):
        reach.append((reach[parents[i]] if parents[i] >= 0 else 1.0) * a)
    return 1.0 + sum(reach)
