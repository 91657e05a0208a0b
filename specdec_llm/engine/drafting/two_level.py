"""Two-level drafting: a draft model's forward also checks a cheaper proposal.

A forward feeds, after the row's pending token, what the row's free drafters offer to follow
its tokens and the drafts so far (prompt lookup, the suffix index: ``FreeDrafter.follow``),
and keeps the longest prefix the draft itself would have produced, plus its own next token:
one forward, several draft tokens. The rule one level down is the target's: greedy, the
draft's argmax; sampled, a one-hot proposal accepted with the draft's probability of it,
else the draft's residual sampled (``sampling.accept_sampled``), so every draft token
follows the draft's own distribution, as the target's rejection rule requires. How much to
check per forward is planned from the measured seconds of a draft forward over w tokens
(``inner_plan``); none is a plain one-token step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..sampling import accept_greedy, accept_sampled, probs
from .base import DraftContext, Proposal, RowView


def inner_plan(seconds: Callable[[int], float], offers: Iterable[Proposal], head: int = 1) -> Proposal | None:
    """Which cheaper proposal (cut to how many tokens) a draft forward should check beside the
    ``head`` tokens it must feed anyway (None: a plain forward); ``seconds(w)``: a draft forward
    over w tokens per row. The choice with the most expected draft tokens per second: a forward
    over ``head + m`` tokens gives the draft's own token plus each of the m proposed tokens it
    agrees with, while it agrees (``Proposal.expected``)."""
    best, choice = 1.0 / seconds(head), None
    for p in offers:
        for m in range(1, len(p.tokens) + 1):
            if (rate := p.expected(m) / seconds(head + m)) > best:
                best, choice = rate, p.cut(m)
    return choice


def to_check(
    context: DraftContext, name: str, row: RowView, drafts: list[int], left: int, head: int, rows: int
) -> list[int]:
    """The cheaper proposal the model drafter ``name``'s next forward for ``row`` checks (at
    most ``left - 1`` tokens: the forward adds the draft's own), beside the ``head`` tokens it
    feeds anyway, in a forward of ``rows`` rows. A seeded sampled row, whose text must not
    depend on timings, checks the first offer whole."""
    if left < 2:
        return []
    offers = context.offers(row, drafts, left - 1)
    if not offers or row.seeded:
        return offers[0].tokens if offers else []
    best = inner_plan(lambda w: context.price(name, rows, w), offers, head)
    return best.tokens if best is not None else []


def accept_checked(row: RowView, checked: list[int], logits: torch.Tensor) -> tuple[int, int, list[torch.Tensor]]:
    """One level down: ``logits`` [m + 1, V] are the draft's at its last token and after each
    of the ``m`` ``checked`` tokens. Returns how many checked tokens the draft keeps, its own
    next token, and (sampled rows) the draft's distribution at each kept position and the next
    one: what the target's rejection rule needs of these tokens."""
    s = row.sampling
    if s.greedy:
        a, nxt = accept_greedy(checked, logits)
        return a, nxt, []
    assert row.gen is not None  # (a sampled row has its generator)
    q = probs(logits, s.temperature, s.top_k, s.top_p)
    a, nxt = accept_sampled(checked, None, q, row.gen)
    return a, nxt, list(q[: a + 1])
