"""Drafters that read token ids only (no model): their proposals cost no forward.

A subclass sets ``name`` and writes ``continuation(row, k)``: at most ``k`` tokens to follow
``row.tokens``, and each one's acceptance bucket (a hashable: tokens of one bucket share a
learnt acceptance rate). Writing ``follow(row, drafts, k)`` too (what follows ``row.tokens +
drafts``) lets a draft model's forwards check its proposals after their own drafts (two
levels). It is its own session: it keeps no per-batch state.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

from .acceptance import Acceptance
from .base import Accepted, Drafts, Event, Left, Proposal, RowView

# a free drafter's acceptance before it has shown any: a guess, not a measurement, kept low
# so that a bucket earns long proposals only from its own verified tokens (GUESS_WEIGHT)
PRIOR = 0.3
# positions past the fourth share a bucket: few proposals reach them, and buckets of their
# own would stay at the prior
POSITIONS = 4


def position(i: int) -> int:
    """A token's position bucket."""
    return min(i, POSITIONS - 1)


class FreeDrafter:
    free, shared, levels = True, False, 1
    feature_layers: tuple[int, ...] = ()
    key = ""
    name: str

    def __init__(self, prior: float = PRIOR):
        self.acceptance = Acceptance(prior)

    def continuation(self, row: RowView, k: int) -> tuple[list[int], list[Hashable]]:
        raise NotImplementedError

    def follow(self, row: RowView, drafts: list[int], k: int) -> tuple[list[int], list[Hashable]]:
        """At most ``k`` tokens to follow ``row.tokens + drafts``: ``drafts`` are a model
        drafter's own tokens of this iteration, whose forwards check these (two-level
        drafting). A drafter that reads only ``row.tokens`` offers nothing past them."""
        return self.continuation(row, k) if not drafts else ([], [])

    def offer(self, row: RowView, k: int, drafts: list[int] | None = None) -> Proposal | None:
        """A proposal of at most ``k`` tokens after ``row.tokens`` (and ``drafts``), or None."""
        tokens, buckets = self.follow(row, drafts or [], k)
        if not tokens:
            return None
        keyed: list[Hashable] = [(row.sampling.greedy, f) for f in buckets]
        return Proposal(self.name, tokens, None, [self.acceptance.rate(f) for f in keyed], keyed)

    @property
    def prior(self) -> float:
        return self.acceptance.prior

    def rate(self, row: RowView) -> float:
        return self.acceptance.prior

    def timer(self, rows: int, ids: list[int]) -> Callable[[int], float] | None:
        return None

    def open(self, target: object) -> FreeDrafter:
        return self

    def propose(self, rows: Sequence[RowView], ks: dict[int, int]) -> Drafts:
        return Drafts({b: p for b, k in ks.items() if (p := self.offer(rows[b], k)) is not None})

    def update(self, events: list[Event]) -> None:
        for e in events:
            if isinstance(e, Accepted) and e.proposal is not None:
                if e.n is not None:
                    self.acceptance.update(e.proposal.buckets, e.n)
                else:
                    self.shadow(e.row, e.proposal, e.emitted)
            elif isinstance(e, Left) and e.finished:
                self.finish(e.row)

    def shadow(self, row: RowView, prop: Proposal, emitted: list[int]) -> None:
        """Learn from a proposal that was made but not verified (another drafter's was, or
        none): on a greedy row the target's tokens of this iteration (``emitted``) say how
        many of its first tokens would have been accepted. Past ``emitted`` nothing is known
        (a censored observation: examined and accepted, no rejection). Without it a drafter
        the plan keeps passing over would never earn the estimate that gets it chosen."""
        if not row.sampling.greedy:
            return  # (sampled: a token's acceptance is a probability, not seen from the output)
        n = next((i for i, (a, b) in enumerate(zip(prop.tokens, emitted)) if a != b), None)
        if n is not None:
            self.acceptance.update(prop.buckets, n)
        else:
            seen = min(len(prop.tokens), len(emitted))
            self.acceptance.update(prop.buckets[:seen], seen)

    def finish(self, row: RowView) -> None:
        """A row finished (a suffix index learns its text)."""
