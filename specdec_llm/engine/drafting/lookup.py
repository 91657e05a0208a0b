"""Prompt lookup: the tokens that followed the latest match of a row's last tokens in its own
prompt and output."""

from __future__ import annotations

from collections.abc import Hashable

from .base import RowView
from .free import PRIOR, FreeDrafter, position


class _RowNgrams:
    """For one growing sequence: the end of the most recent occurrence of every n-gram
    (n <= max_n) that has a continuation, updated incrementally as tokens arrive."""

    last: dict[tuple[int, ...], int]

    def __init__(self, max_n: int):
        self.max_n, self.seen, self.last = max_n, 1, {}

    def update(self, seq: list[int]) -> None:
        for e in range(self.seen, len(seq)):  # n-grams ending at e have seq[e] as continuation
            for n in range(1, min(self.max_n, e) + 1):
                self.last[tuple(seq[e - n : e])] = e
        self.seen = max(self.seen, len(seq))


class Lookup(FreeDrafter):
    """The longest recent match of the sequence's last n tokens (n from ``max_n`` down to
    ``min_n``) in the row's own prompt and output; the tokens that followed it are proposed.
    A token's bucket is (match length, position), so a long match earns longer proposals
    once it has proven itself."""

    name = "lookup"

    # max_n 4: transformers' prompt lookup and vLLM's ngram drafter default to n-grams of 1-4
    # (prompt_lookup_max = 4 in vLLM's SpeculativeConfig); a longer match is rarer and gains
    # little, since a match's acceptance is learnt per match length (the buckets) anyway
    def __init__(self, max_n: int = 4, min_n: int = 1, prior: float = PRIOR):
        super().__init__(prior)
        self.max_n, self.min_n = max_n, min_n

    def continuation(self, row: RowView, k: int) -> tuple[list[int], list[Hashable]]:
        return self.follow(row, [], k)

    def follow(self, row: RowView, drafts: list[int], k: int) -> tuple[list[int], list[Hashable]]:
        """Matches are looked up in ``row.tokens`` (the index covers it); the n-gram to match
        may end in ``drafts``, and what followed the match may run into them."""
        index = row.state.get(self.name)
        if index is None:
            index = row.state[self.name] = _RowNgrams(self.max_n)
        index.update(row.tokens)
        seq = row.tokens + drafts if drafts else row.tokens
        for n in range(min(self.max_n, len(seq) - 1), self.min_n - 1, -1):
            e = index.last.get(tuple(seq[-n:]))
            if e is not None:
                tokens = seq[e : e + k]
                return tokens, [(n, position(i)) for i in range(len(tokens))]
        return [], []
