"""A row's tree: its chain and the branches that pay (tree.py verifies and accepts them).

The plan's proposal for a row is its chain; the other drafters' offers for the row, and a
model drafter's own alternatives (``Proposal.branches``), join it as branches, each where it leaves the
tree, as far as it pays. A node's chance of being accepted is its parent's times its own
acceptance estimate times what its earlier siblings leave (greedy: one child at most is the
target's token); the tokens a tree is expected to give are one plus the sum of those
chances. A branch's tail is kept up to the length whose expected tokens are worth more than
the wider verification costs (the cost model's measured verify seconds per width), at most
``limit`` nodes in all; where nothing pays, the chain is the tree of width 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .drafting.base import Proposal
from .tree import chain_parents, children


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
